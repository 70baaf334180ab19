"""The shape of the code, checked: integrations stand on the public surface only, the core's layers
import downwards only, no module imports itself back through others, and the private names of torch,
Lightning, Accelerate and Megatron are read only in their quarantine modules. Every import counts: at
the top of a module, inside a function, under ``if TYPE_CHECKING:`` and ``importlib.import_module``
with a literal name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "packages" / "bcp-core" / "src"
INTEGRATIONS = [ROOT / "packages" / f"bcp-{n}" / "src" for n in ("megatron", "lightning", "accelerate", "transformers")]
PUBLIC = {"bcp", "bcp.integration"}

# Lowest first. A module may import its own layer's modules and those of strictly lower layers;
# layers of one rank are peers and do not import each other.
# bcp.torch_internals (torch's private names) sits below every layer that reads one.
LAYERS = {
    "bcp.errors": 0, "bcp.version": 0, "bcp.wire_records": 0, "bcp.chunk_codecs": 0,
    "bcp.torch_internals": 1,
    "bcp.layout": 2,
    "bcp.storage": 3, "bcp.coord": 3,
    "bcp.engine": 4,
    "bcp.planning": 5, "bcp.adapters": 5,
    "bcp.api": 6,
    "bcp.tools": 7, "bcp.integration": 7, "bcp.tier": 7,
    "bcp.cli": 8, "bcp": 8,
}
# The frameworks whose private names bcp reads, and the one module (or package) each is read in.
FRAMEWORKS = {"torch", "torchdata", "lightning", "pytorch_lightning", "accelerate", "megatron", "transformers"}
QUARANTINES = ("bcp.torch_internals", "bcp_lightning.lightning_patch", "bcp_accelerate.accelerate_patch",
               "bcp_transformers.transformers_patch")
# Private names of Python's standard library that bcp reads on objects the walk cannot trace to their
# import: a namedtuple's ``_make``, a ThreadPoolExecutor's ``_max_workers``.
STANDARD_LIBRARY_PRIVATE = {"_make", "_max_workers"}


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
    return module if module in ("bcp", "bcp.errors", "bcp.version", "bcp.wire_records", "bcp.chunk_codecs") else ".".join(module.split(".")[:2])


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


def test_private_framework_names_are_read_only_in_their_quarantine():
    found = _private_framework_names(_sources())
    assert not found, "private framework names outside " + ", ".join(QUARANTINES) + ":\n" + "\n".join(found)


def _sources() -> dict[str, Path]:
    modules = dict(_modules(CORE))
    for src in INTEGRATIONS:
        modules.update(_modules(src))
    return {m: p for m, p in modules.items() if not m.endswith(("_pb2", "_pb2_grpc"))}  # generated by protoc


def _private_framework_names(modules: dict[str, Path]) -> list[str]:
    """``module:line: expression`` for each private name of a framework read outside the quarantines:
    an import of a framework's private module or name, an attribute reached from a framework's
    module, and a private attribute (or ``getattr``/``setattr``/``hasattr`` of one) of any other
    object that neither bcp itself defines (a ``def``/``class``, a class attribute, ``self._x = ``,
    a ``_bcp`` mark) nor the standard library has (``STANDARD_LIBRARY_PRIVATE``)."""
    trees = {module: ast.parse(path.read_text()) for module, path in modules.items()}
    own = set().union(*(_private_names_defined(tree) for tree in trees.values()))
    found = []
    for module, tree in trees.items():
        if any(module == q or module.startswith(q + ".") for q in QUARANTINES):
            continue
        imported = _imported_names(tree)
        for line, text in _private_reads(tree, imported, own):
            found.append(f"{module}:{line}: {text}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_names_defined(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else \
                    [statement.target] if isinstance(statement, ast.AnnAssign) else []
                names.update(target.id for target in targets if isinstance(target, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Each name a module binds by an import, with the module or object it is bound to."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _private_reads(tree: ast.AST, imported: dict[str, str], own: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        for name in _framework_import(node):
            if any(_private(part) for part in name.split(".")):
                found.append((node.lineno, f"import {name}"))
        read = _private_attribute(node)
        if read is None:
            continue
        owner, name = read
        root = owner
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in imported:
            framework = imported[root.id].split(".")[0] in FRAMEWORKS
        elif isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            framework = False
        else:  # an object the walk cannot trace: a private name bcp does not define is someone else's
            framework = name not in own and not name.startswith("_bcp") and name not in STANDARD_LIBRARY_PRIVATE
        if framework:
            found.append((node.lineno, f"{ast.unparse(owner)}.{name}"))
    return found


def _framework_import(node: ast.AST) -> list[str]:
    """The framework names ``node`` imports (``from torch.x import _y`` -> ``torch.x._y``)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif _is_import_module_call(node):
        names = [node.args[0].value]
    else:
        return []
    return [name for name in names if name.split(".")[0] in FRAMEWORKS]


def _private_attribute(node: ast.AST) -> tuple[ast.expr, str] | None:
    """``(owner, name)`` where ``node`` reads or sets ``owner._name``, directly or by ``getattr``,
    ``setattr`` or ``hasattr`` with a literal name."""
    if isinstance(node, ast.Attribute) and _private(node.attr):
        return node.value, node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1:
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
            return node.args[0], name.value
    return None


def test_the_quarantine_check_catches_a_private_framework_name(tmp_path):
    # the check is only as good as its ability to fail: each way of reaching a private name, planted
    files = {
        "bcp/coord/bad.py": ("import torch.distributed as dist\n"
                             "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset\n"
                             "def f(group, tensor, accelerator):\n"
                             "    dist.distributed_c10d._world.pg_map\n"
                             "    tensor._version\n"
                             "    getattr(accelerator, '_models')\n"
                             "    importlib.import_module('torch._dynamo')\n"),
        "bcp/coord/fine.py": ("import sys\nimport threading\n"
                              "class Group:\n    _lock = None\n"
                              "    def __init__(self):\n        self._parents = []\n"
                              "    def _anchor(self, parent):\n        parent._bcp_mark = True\n"
                              "def f(group, kind, pool):\n"
                              "    sys._getframe(1)\n    threading._register_atexit\n"
                              "    group._anchor(None), group._parents, kind._make([]), pool._max_workers\n"),
        "bcp/torch_internals/__init__.py": "import torch\ndef f(t):\n    return t._version, torch._C\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert sorted(_private_framework_names(_modules(tmp_path))) == sorted([
        "bcp.coord.bad:2: import torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
        "bcp.coord.bad:4: dist.distributed_c10d._world",
        "bcp.coord.bad:5: tensor._version",
        "bcp.coord.bad:6: accelerator._models",
        "bcp.coord.bad:7: import torch._dynamo",
    ])
