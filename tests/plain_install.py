"""What the README's install (`pip install .`, no extras) must run: `compress inspect` of every shipped recipe, and
every shipped recipe that writes an export, run with its own stages and formats on a tiny llama (the export written
and, where the format's reader is installed, verified).

    python tests/plain_install.py WORK [--inspect] [--exports] [--block-extras]

--block-extras makes the packages that only the optional extras install (pyproject.toml) fail to import, as they
would after a plain install; tests/test_plain_install.py runs it so, and in a fresh virtual environment (slow).
Prints one JSON line per recipe; exits 1 when any failed.
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("-", "_")


def extras_only_modules() -> set[str]:
    """Top-level modules of the distributions an optional extra installs and the core dependencies do not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    extra = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs} - core - {"pytest"}
    modules = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if any(d.lower().replace("-", "_") in extra for d in dists):
            modules.add(module)
    return modules


class Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, modules: set[str]):
        self.modules = modules

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.modules:
            raise ModuleNotFoundError(f"No module named {name!r} (an optional extra, blocked)", name=name)
        return None


def shipped_recipes() -> list[Path]:
    return sorted((ROOT / "recipes").glob("*.yaml"))


def inspect_all() -> list[dict]:
    """`compress inspect` of each shipped recipe whose model is here (`default` or a local path; a recipe naming a
    hub model is listed as not inspected: no network here)."""
    import yaml

    from compress.cli import main

    rows = []
    for recipe in shipped_recipes():
        model = yaml.safe_load(recipe.read_text())["model"]
        source = model if isinstance(model, str) else model.get("source", "default")
        if source != "default" and not Path(source).exists():
            rows.append({"recipe": recipe.name, "inspect": "ok", "note": f"not inspected: {source} is a hub model"})
            continue
        try:
            rc = main(["inspect", str(recipe), "--json"])
            rows.append({"recipe": recipe.name, "inspect": "ok" if rc == 0 else f"exit {rc}"})
        except Exception as exc:  # noqa: BLE001 - every recipe reported, then the exit status says
            rows.append({"recipe": recipe.name, "inspect": f"{type(exc).__name__}: {exc}"})
    return rows


def export_runs(work: Path) -> list[dict]:
    """Each shipped recipe with output.formats, on a tiny llama: its stages and formats, little calibration."""
    import yaml

    from compress import run

    sys.path.append(str(ROOT))  # after the installed compress: only tests/ is read from the checkout
    from tests.conftest import make_tiny_model
    from tests.tiny_tokenizer import byte_bpe_tokenizer, word_text

    folder = work / "tiny"
    make_tiny_model("llama").save_pretrained(folder)
    byte_bpe_tokenizer().save_pretrained(folder)  # byte-level BPE: what the GGUF exporter writes a vocabulary for
    calib = work / "calib.txt"
    calib.write_text(word_text(4096) + "\n")
    rows = []
    for recipe in shipped_recipes():
        data = yaml.safe_load(recipe.read_text())
        formats = (data.get("output") or {}).get("formats") or []
        if not formats:
            continue
        data.update(model={"source": str(folder), "dtype": "float32", "device": "cpu"},
                    calibration={"kind": "files", "files": [str(calib)], "n_samples": 4, "seq_len": 64},
                    eval={"perplexity": False, "speed": False, "baseline": False, "samples": 0},
                    output={"dir": str(work / recipe.stem), "formats": formats})
        try:
            report = run(data, progress=False, log=lambda m: None).data
            rows.append({"recipe": recipe.name, "exports": {
                e["format"]: e["verify"]["loader"] if e.get("verify") else
                "; ".join(n for n in e["notes"] if n.startswith("not verified")) or "written"
                for e in report["exports"]}})
        except Exception as exc:  # noqa: BLE001
            rows.append({"recipe": recipe.name, "exports": f"{type(exc).__name__}: {exc}"})
    return rows


def failed(row: dict) -> bool:
    return row.get("inspect", "ok") != "ok" or isinstance(row.get("exports", {}), str)


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    if "--block-extras" in argv:
        sys.meta_path.insert(0, Blocker(extras_only_modules()))
    import contextlib
    import io

    import compress

    rows = [{"compress": compress.__file__}]
    if "--inspect" in argv:
        with contextlib.redirect_stdout(io.StringIO()):  # inspect's own printing
            rows += inspect_all()
    if "--exports" in argv:
        rows += export_runs(work)
    for row in rows:
        print(json.dumps(row))
    return 1 if any(map(failed, rows)) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
