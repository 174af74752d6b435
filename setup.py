"""Build hook only (the project's metadata is in pyproject.toml): a wheel carries the repository's recipes/,
calib/ and eval/ folders inside the package as compress/_bundled/, where compress/resources.py finds them when
compress is installed outside a checkout."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUNDLED = ("recipes", "calib", "eval")


class build_py_with_resources(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "compress" / "_bundled"
        for name in BUNDLED:
            shutil.rmtree(target / name, ignore_errors=True)
            shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": build_py_with_resources})
