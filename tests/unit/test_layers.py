"""The package's import graph: no cycle, and dependencies point one way.

tasks -> config -> ops -> models -> batch -> parallel -> rollout -> train/callbacks -> cli:
a module imports only its own layer and the layers before it (function-level imports
count), and nothing in the package imports a benchmark. docs/architecture.md draws it.
"""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOTS = {"spectrain": REPO / "spectrain", "spectrain.callbacks": REPO / "callbacks",
                 "spectrain.kernels": REPO / "kernels"}
# Each entry: module-name prefixes of one layer, lowest first.
LAYERS = [
    ("spectrain.errors", "spectrain.internals", "spectrain.plots", "spectrain.machine", "spectrain.console",
     "spectrain.cpu_runtime"),
    ("spectrain.tasks",),
    ("spectrain.config",),
    ("spectrain.ops", "spectrain.kernels"),
    ("spectrain.models",),
    ("spectrain.batch",),
    ("spectrain.parallel",),
    ("spectrain.rollout",),
    ("spectrain.train", "spectrain.callbacks"),
    ("spectrain.evaluate",),
    ("spectrain.cli", "spectrain.__main__"),
]


def _module_name(path: Path) -> str:
    for package, root in sorted(PACKAGE_ROOTS.items(), key=lambda kv: -len(kv[0])):
        if path.is_relative_to(root):
            parts = list(path.relative_to(root).with_suffix("").parts)
            return ".".join([package] + (parts[:-1] if parts[-1] == "__init__" else parts))
    raise AssertionError(path)


def _imports(path: Path, module: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.split(".")[: -node.level + (path.name == "__init__.py") or None]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("spectrain", "benchmarks")}


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for root in PACKAGE_ROOTS.values():
        for path in root.rglob("*.py"):
            name = _module_name(path)
            graph[name] = _imports(path, name)
    return graph


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


GRAPH = import_graph()


def test_every_module_has_a_layer():
    for module in GRAPH:
        if module != "spectrain":
            layer_of(module)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m != "spectrain"))
def test_dependencies_point_down(module):
    own = layer_of(module)
    for dep in sorted(GRAPH[module]):
        assert not dep.startswith("benchmarks"), f"{module} imports the benchmark {dep}"
        if dep == "spectrain":
            continue
        assert layer_of(dep) <= own, (f"{module} (layer {LAYERS[own]}) imports {dep} (layer {LAYERS[layer_of(dep)]}), "
                                      f"a layer above it")


def test_no_import_cycle():
    resolved = {m: {d for d in deps if d in GRAPH} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(resolved[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(resolved):
        if module not in state:
            visit(module, [module])


def test_the_rules_can_fail():
    """The checks above see function-level imports and would flag an upward one."""
    graph = {"spectrain.models.x": _imports_of("def f():\n    from spectrain.train.module import GRPOModule\n")}
    assert graph["spectrain.models.x"] == {"spectrain.train.module"}
    assert layer_of("spectrain.train.module") > layer_of("spectrain.models.x")


def _imports_of(source: str) -> set[str]:
    tmp = REPO / "build" / "layers_probe.py"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(source)
    try:
        return _imports(tmp, "spectrain.models.x")
    finally:
        tmp.unlink()
