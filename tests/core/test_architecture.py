"""The shape of the code, checked: integrations stand on the public surface only, the core's layers
import downwards only, and no module imports itself back through others."""

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
    "bcp.errors": 0, "bcp.version": 0,
    "bcp.layout": 1,
    "bcp.storage": 2, "bcp.coord": 2,
    "bcp.engine": 3,
    "bcp.planning": 4, "bcp.adapters": 4,
    "bcp.api": 5,
    "bcp.tools": 6, "bcp.integration": 6,
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


def _imports(path: Path, top_level_only: bool = False) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def _layer(module: str) -> str:
    return module if module in ("bcp", "bcp.errors", "bcp.version") else ".".join(module.split(".")[:2])


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


def test_no_import_cycles_between_core_modules():
    core = _modules(CORE)
    graph = {m: {t for n in _imports(p, top_level_only=True) if (t := _resolved(n, core)) and t != m
                 and not m.startswith(t + ".")}  # a module's package is imported before it: not a cycle
             for m, p in core.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = 2
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


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
