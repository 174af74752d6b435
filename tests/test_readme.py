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


# --- the README is a front door; the docs hold the rest, each figure in one place -----------------------------------

DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
MAX_README_LINES = 350


def _unfenced(text: str) -> str:
    """The text without fenced code blocks (a `# comment` there is no heading, a `[x](y)` no link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The text without code: fenced blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(text))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation other than '-' and '_' dropped, spaces to '-'; a repeated
    heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _unfenced(path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text()))


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def test_the_link_checker_reads_headings_and_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n## Int8 / int4 KV cache (KIVI)\n\n```\n# not a heading\n```\n## Results\n"
                    "### Capacity planning: `compress plan`\n")
    assert _anchors(page) == {"results", "int8--int4-kv-cache-kivi", "results-1", "capacity-planning-compress-plan"}
    page.write_text("[a](other.md#x) `[b](skipped.md)`\n")
    assert _links(page) == ["other.md#x"]


# A measured figure: a decimal number (1.66, 0.0957, 12.34, 1.01e-04), without the version strings around it.
_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?)(?![\w]|\.\d)")
_VERSION = re.compile(r"(?:torch|transformers|vLLM|vllm|Python|python|llama-cpp-python|nvcc|CUDA|cu|v|version)"
                      r"[\s=<>≥]*$")


def _figures(text: str, digits: int) -> set[str]:
    """The figures in `text` with at least `digits` significant digits (leading zeros do not count)."""
    out = set()
    for m in _NUMBER.finditer(text):
        mantissa = m.group(1).split("e")[0]
        if len(mantissa.replace(".", "").lstrip("0")) >= digits and \
                not _VERSION.search(text[max(0, m.start() - 24):m.start()]):
            out.add(m.group(1))
    return out


def test_no_figure_is_in_two_places():
    """A figure lives in one place (docs/results.md, or the page that owns it: engines.md, gpu.md, coverage.md), so
    that a new measurement changes one line. The README states results qualitatively: it shares no figure of three or
    more significant digits with any docs page. Between two docs pages the test reads four or more: at three, values
    of different quantities coincide in the large tables (0.0393 is a GGUF KL in results.md and a vLLM log-prob gap
    in engines.md), and no exception list would stay true."""
    readme = _figures((ROOT / "README.md").read_text(), 3)
    twice = [f"README.md and docs/{doc.name}: {sorted(readme & _figures(doc.read_text(), 3))}" for doc in DOCS
             if readme & _figures(doc.read_text(), 3)]
    figures = {doc: _figures(doc.read_text(), 4) for doc in DOCS}
    for i, a in enumerate(DOCS):
        for b in DOCS[i + 1:]:
            if shared := figures[a] & figures[b]:
                twice.append(f"docs/{a.name} and docs/{b.name}: {sorted(shared)}")
    assert not twice, "the same figure in two places (keep it in one, link to it from the other):\n" + "\n".join(twice)


def test_the_figure_reader_skips_versions_and_short_numbers():
    text = "torch==2.13.0, transformers 5.25, Python ≥ 3.11, 0.90×, KL 0.0957, 1.66× bf16, 1.01e-04, ppl 19.134, 2026-12-01"
    assert _figures(text, 3) == {"0.0957", "1.66", "1.01e-04", "19.134"}
    assert _figures(text, 4) == {"19.134"}
