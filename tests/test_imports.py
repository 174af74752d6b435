"""The package's modules import each other without a cycle. Every import counts, including the ones inside
functions: a deferred import hides a cycle, it does not remove it."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import compress

PACKAGE = Path(compress.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (`from .x import y` counts x, and x.y when
    y is a module)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [name] + [f"{name}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_deferred_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")  # deferred, still a cycle
    (pkg / "c.py").write_text("from . import a\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_importing_the_package_changes_nothing_in_the_process():
    """`import compress` sets no environment variable and loads no torch (the CLI sets its own process defaults)."""
    code = ("import os, sys; before = dict(os.environ); import compress; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "assert 'torch' not in sys.modules; assert compress.QuantScheme.__name__ == 'QuantScheme'")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# The packages by role, lowest first: a module imports only from its own layer or lower ones (docs/architecture.md).
# A name is a subpackage of compress, or a top-level module written in full.
LAYERS = (
    ("compress._version", "compress.resources", "compress.threads"),  # what every package may use
    ("core",),             # the numbers: scheme, primitives, packed tensors, QuantLinear, the reference matmuls
    ("kernels",),          # fast paths of the reference ops
    ("arch",),             # one record per model family
    ("calibrate", "prune", "kv"),
    ("transforms",),       # function-preserving rewrites (rotation, smoothing)
    ("quantizers",),       # weight methods
    ("serving",),          # decode loops, speculative decoding, capacity planner, roofline
    ("measure",),          # perplexity, KL, lm-eval, memory, speed
    ("export",),           # serving formats (and the shards they are written in)
    ("model",),            # where models come from: hub, folder, GGUF, our own checkpoints, streamed blocks
    ("engines",),          # an export run by the engine itself
    ("precision",),        # mixed precision: sensitivities and the knapsack
    ("distill",),          # training after compression
    ("stages",),           # recipe stages: they compose everything below
    ("pipeline", "compress.recipe"),
    ("api",),              # the Python API: compress / evaluate / load / run, and what they return
    ("cli", "compress", "compress.__main__"),
)


def layer_of(module: str) -> int:
    parts = module.split(".")
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or (not name.startswith("compress") and len(parts) > 1 and parts[1] == name):
                return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and to docs/architecture.md)")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_no_package_imports_a_higher_one():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    graph = import_graph()
    graph["compress.core.scheme"] = graph["compress.core.scheme"] | {"compress.pipeline.resident"}
    assert upward_imports(graph) == ["compress.core.scheme -> compress.pipeline.resident"]


def test_top_level_keeps_what_every_package_uses():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top


def _functions(root: Path = PACKAGE):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(root.parent), node


def test_no_function_is_longer_than_a_screenful_or_two():
    """Issue 47's bar: no function over 120 lines (a longer one is several steps that want names)."""
    long = [f"{path}:{node.name} ({node.end_lineno - node.lineno + 1} lines)" for path, node in _functions()
            if node.end_lineno - node.lineno + 1 > 120]
    assert long == []


def test_the_runner_takes_small_objects_not_long_argument_lists():
    """No function of the runner (pipeline/, calibrate/) takes more than 8 parameters: what travels together is one
    dataclass (BlockPass, PassExtras, RunOptions)."""
    def count(a: ast.arguments) -> int:
        n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
        return n - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)

    wide = [f"{path}:{node.name} ({count(node.args)})" for path, node in _functions()
            if path.parts[1] in ("pipeline", "calibrate") and count(node.args) > 8]
    assert wide == []
