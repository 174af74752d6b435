"""The YAML and task files that ship with compress: recipes/, calib/ (calibration presets) and eval/ (evaluation
suites and lm-eval task files).

They live at the top of the repository. A checkout (or an editable install) reads them there; a wheel carries a
copy inside the package, at compress/_bundled/<name>/ (setup.py's build_py puts it there), so `pip install .`
and a built wheel find them wherever they are installed.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED = PACKAGE_DIR / "_bundled"
NAMES = ("recipes", "calib", "eval")
ENV_CACHE = "COMPRESS_CACHE"


def cache_dir() -> Path:
    """Where compress keeps what it downloads or builds (the embedded model, compiled CPU kernels): $COMPRESS_CACHE,
    else ~/.cache/compress."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "compress").expanduser()


def resource_dir(name: str) -> Path:
    """The folder holding `name` (one of NAMES): the checkout's own, else the copy bundled in the package."""
    if name not in NAMES:
        raise ValueError(f"unknown resource folder {name!r}; known: {NAMES}")
    for folder in (PACKAGE_DIR.parent / name, BUNDLED / name):
        if folder.is_dir() and (folder.parent == BUNDLED or (PACKAGE_DIR.parent / "pyproject.toml").is_file()):
            return folder
    raise FileNotFoundError(f"compress's {name}/ folder is missing (looked in {PACKAGE_DIR.parent / name} and "
                            f"{BUNDLED / name}); reinstall compress (pip install .) or run from a checkout")


def find_recipe(path: str | Path) -> Path:
    """A recipe path as given, or, when no such file exists, the recipe of that name shipped with compress:
    `recipes/awq_int4.yaml`, `awq_int4.yaml` and `awq_int4` all name recipes/awq_int4.yaml outside a checkout."""
    path = Path(path)
    if path.is_file():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    if path.parent in (Path("."), Path("recipes")):
        shipped = resource_dir("recipes") / name
        if shipped.is_file():
            return shipped
    return path


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in resource_dir("recipes").glob("*.yaml"))
