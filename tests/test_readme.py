"""The README's commands and recipe list stay true: CI runs exactly the README's test command."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    test_command = _bash_blocks()[1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines
    assert ci_lines.index("pip install -q torch==2.13.0") < ci_lines.index(test_command)


def test_readme_main_command_names_a_shipped_recipe():
    main = _bash_blocks()[0]
    recipe = re.search(r"compress run (\S+)", main).group(1)
    assert (ROOT / recipe).is_file()


def test_every_recipe_is_documented():
    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        assert f"recipes/{path.name}" in readme, path.name
