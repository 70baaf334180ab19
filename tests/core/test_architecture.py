"""The shape of the code, checked: integrations stand on the public surface only, the core's layers
import downwards only, and no module imports itself back through others. Every import counts: at
the top of a module, inside a function, under ``if TYPE_CHECKING:`` and ``importlib.import_module``
with a literal name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "packages" / "bcp-core" / "src"
INTEGRATIONS = [ROOT / "packages" / name / "src" for name in ("bcp-megatron", "bcp-lightning", "bcp-accelerate")]
PUBLIC = {"bcp", "bcp.integration"}

# Lowest first. A module may import its own layer's modules and those of strictly lower layers;
# layers of one rank are peers and do not import each other.
LAYERS = {
    "bcp.errors": 0, "bcp.version": 0, "bcp.wire_records": 0,
    "bcp.layout": 1,
    "bcp.storage": 2, "bcp.coord": 2,
    "bcp.engine": 3,
    "bcp.planning": 4, "bcp.adapters": 4,
    "bcp.api": 5,
    "bcp.tools": 6, "bcp.integration": 6, "bcp.tier": 6,
    "bcp.cli": 7, "bcp": 7,
}


def _modules(src: Path) -> dict[str, Path]:
    found = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif _is_import_module_call(node):
            names.append(node.args[0].value)
    return names


def _is_import_module_call(node: ast.AST) -> bool:
    """``importlib.import_module("literal")`` (or ``import_module("literal")``)."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant) \
            or not isinstance(node.args[0].value, str):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id == "import_module")


def _layer(module: str) -> str:
    return module if module in ("bcp", "bcp.errors", "bcp.version", "bcp.wire_records") else ".".join(module.split(".")[:2])


def test_integrations_import_only_the_public_surface():
    offending = []
    for src in INTEGRATIONS:
        for module, path in _modules(src).items():
            for name in _imports(path):
                if (name == "bcp" or name.startswith("bcp.")) and name not in PUBLIC \
                        and not any(name.startswith(p + ".") and name.count(".") == p.count(".") + 1
                                    for p in PUBLIC):
                    offending.append(f"{module} imports {name}")
    assert not offending, "integrations must import only bcp and bcp.integration:\n" + "\n".join(offending)


def test_core_layers_import_downwards_only():
    wrong = _layering_violations(_modules(CORE))
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _layering_violations(core: dict[str, Path]) -> list[str]:
    wrong = []
    for module, path in core.items():
        if module == "bcp":
            continue
        own = _layer(module)
        for target in sorted({_resolved(name, core) for name in _imports(path)} - {None}):
            if _layer(target) == own:
                continue
            if LAYERS[_layer(target)] >= LAYERS[own]:
                wrong.append(f"{module} ({own}) imports {target} ({_layer(target)})")
    return wrong


def test_no_import_cycles():
    modules = dict(_modules(CORE))
    for src in INTEGRATIONS:
        modules.update(_modules(src))
    cycles = _import_cycles(modules)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def _import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """One cycle per group of modules that import each other, each as ``[a, b, ..., a]``."""
    graph = {m: {t for n in _imports(p) if (t := _resolved(n, modules)) and t != m
                 and not m.startswith(t + ".")}  # a module's package is imported before it: not a cycle
             for m, p in modules.items()}
    cycles: list[list[str]] = []
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        cycle = _cycle_through(start, graph)
        if cycle:
            cycles.append(cycle)
            done.update(cycle)
        done.add(start)
    return cycles


def _cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """The shortest import path from ``start`` back to itself, if any (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph.get(module, ())):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in previous:
                    previous[target] = module
                    following.append(target)
        frontier = following
    return None


def _resolved(name: str, modules: dict[str, Path]) -> str | None:
    """The core module an imported name belongs to (``bcp.x.y.Name`` -> ``bcp.x.y``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_the_layering_check_catches_an_upward_import(tmp_path):
    # the check is only as good as its ability to fail: an engine module importing planning
    for module, text in {"engine/bad.py": "from bcp.planning.load_plan import plan_reads\n",
                         "planning/load_plan.py": "from bcp.engine.reader import ShardReader\n",
                         "engine/reader.py": ""}.items():
        (tmp_path / "bcp" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "bcp" / module).write_text(text)
    assert _layering_violations(_modules(tmp_path)) == [
        "bcp.engine.bad (bcp.engine) imports bcp.planning.load_plan (bcp.planning)"]


def test_the_cycle_check_sees_imports_inside_functions_and_type_checking_blocks(tmp_path):
    # both halves of each cycle are imports the top level does not show
    files = {
        "bcp/tools/report.py": "def draw():\n    from bcp.tools.heatmap import draw_heatmap\n",
        "bcp/tools/heatmap.py": "from bcp.tools.report import Report\n",
        "bcp/api/results.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bcp.api.metrics import Monitor\n",
        "bcp/api/metrics.py": "from bcp.api.results import PhaseStats\n",
        "plugin_autoload.py": "import importlib\ndef hook():\n    importlib.import_module('plugin')\n",
        "plugin/__init__.py": "from plugin_autoload import NAME\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _import_cycles(_modules(tmp_path)) == [
        ["bcp.api.metrics", "bcp.api.results", "bcp.api.metrics"],
        ["bcp.tools.heatmap", "bcp.tools.report", "bcp.tools.heatmap"],
        ["plugin", "plugin_autoload", "plugin"]]
