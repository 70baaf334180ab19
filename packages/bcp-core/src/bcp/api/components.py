"""The values of a state and how each goes back after a load.

:func:`collect` names every value of the parts :mod:`bcp.api.state_walk` finds: ``<path>/<fqn>`` for
a module's tensors (through its adapter), ``<path>/state/<param fqn>/<key>`` and
``<path>/param_groups`` for an optimizer's (through the adapter of the module that owns its
parameters), ``<path>`` for a sharded or plain tensor and for a per-rank value (the tensors a value
holds are saved as ``<path>/<segment>/...``, ``layout.values``), ``dataloader/<part>`` for a
dataloader's parts. ``{"model": m, "optimizer": o}`` keeps the names it always had.

An optimizer is restored as ``torch.optim.Optimizer.load_state_dict`` restores it: a parameter the
checkpoint holds no state for has none after the load (its live state is removed, not reported
missing); a parameter with part of its state saved is a mismatch like any missing tensor.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Mapping

import torch
from torch import nn

from bcp.adapters import adapter_for
from bcp.adapters.base import FrameworkAdapter
from bcp.adapters.dataloader import COMPONENT as DATALOADER
from bcp.adapters.dataloader import DataloaderState
from bcp.adapters.optimizer import MERGED, wanted_as_saved
from bcp.api.in_place import into_live, plain_copy
from bcp.api.state_walk import MODEL, OPTIMIZER, Leaf, ModuleComponent, OptimizerComponent, StateParts, Stateful, walk
from bcp.api.undo import Undo
from bcp.errors import AdapterError, CheckpointError, MismatchError
from bcp.layout.values import tensor_refs

#: The value of a name a load leaves unread (a dataloader part another DP rank receives).
SKIP = object()
#: The value of a saved tensor a load reads where the live state holds none (it is then placed).
PLACED = object()


def check_keys(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"state must be a dict of components, got {type(state).__name__}")
    for key in state:
        if not isinstance(key, str) or not key or "/" in key:
            raise CheckpointError(f"component names must be non-empty strings without '/': {key!r}")


@dataclass(slots=True)
class _Bound:
    """One module part or optimizer with its adapter and the names of its values."""

    obj: Any
    model: Any
    adapter: FrameworkAdapter
    names: set[str] = field(default_factory=set)


@dataclass(slots=True)
class StateValues:
    """Every value of a state by full name, what kind each is, and how loaded ones go back."""

    values: dict[str, Any] = field(default_factory=dict)
    #: Names of tensors saved as boxes and resharded (modules', optimizers', sharded tensors).
    resharded: set[str] = field(default_factory=set)
    #: Names of per-rank values (each rank's own).
    per_rank: set[str] = field(default_factory=set)
    #: Names of plain tensors (``planning.plain_tensors``: saved as tensor entries or per rank).
    plain: set[str] = field(default_factory=set)
    #: A load's: per per-rank value, the saved names of the tensors it holds (``<name>/...``).
    held: dict[str, list[str]] = field(default_factory=dict)
    #: Names whose records from every saved rank are loaded together (optimizers' param groups,
    #: resolved by parameter name: which parameters a rank holds changes with the layout).
    merged: set[str] = field(default_factory=set)
    #: The adapter of the ``model`` component (else of the first module), "none" without modules.
    framework: str = "none"
    modules: list[tuple[str, list[_Bound]]] = field(default_factory=list)
    optimizers: list[tuple[str, list[_Bound]]] = field(default_factory=list)
    leaves: list[Leaf] = field(default_factory=list)
    plain_leaves: list[Leaf] = field(default_factory=list)
    statefuls: list[Stateful] = field(default_factory=list)
    dataloader: DataloaderState | None = None

    def add(self, name: str, value: Any, kind: set[str] | None = None) -> None:
        if name in self.values:
            raise MismatchError("two parts of the state give this name (a list of model parts with a parameter "
                                "name in common, or two optimizers over one parameter)", key=name)
        self.values[name] = value
        if kind is not None:
            kind.add(name)

    def check(self, loaded: dict[str, Any], path: str) -> None:
        """Raise where an adapter would refuse ``loaded`` while applying it, changing nothing (the
        optimizers' param groups), so that the load fails before anything is placed."""
        for component, bound in self._loaded_optimizers(loaded):
            for item in bound:
                try:
                    item.adapter.check_optimizer_state(item.model, item.obj, _within(component, item.names, loaded))
                except CheckpointError as exc:
                    raise exc.at(path) from None

    def apply(self, loaded: dict[str, Any], undo: Undo) -> None:
        """Give loaded values back to the live objects (tensors were already filled in place);
        ``undo`` records how to give each object its previous state back. The dataloader goes last:
        nothing after it can fail, and it is not given its previous state back."""
        kept_trees = {id(s): plain_copy(s.tree) for s in self.statefuls if self._takes(s, loaded)}
        for component, bound in self.modules:
            for part in bound:
                values = _within(component, part.names, loaded)
                if values:
                    undo.on_object(part.adapter.kept_model_state(part.obj))
                    with _applying(component):
                        part.adapter.load_model_state(part.obj, values)
        for component, bound in self._loaded_optimizers(loaded):
            for item in bound:
                undo.on_object(item.adapter.kept_optimizer_state(item.model, item.obj))
                with _applying(component):
                    item.adapter.load_optimizer_state(item.model, item.obj, _within(component, item.names, loaded))
        for leaf in [*self.leaves, *self.plain_leaves]:
            if leaf.path in loaded:
                undo.on_contents(_put_back(leaf.container, leaf.key, leaf.container[leaf.key]))
                leaf.container[leaf.key] = into_live(leaf.container[leaf.key], loaded[leaf.path], undo)
        for stateful in reversed(self.statefuls):  # inner objects before the objects holding them
            if id(stateful) in kept_trees:
                undo.on_object(_state_back(stateful.obj, kept_trees[id(stateful)]))
                tree = stateful.tree if stateful.walked else into_live(stateful.tree, loaded[stateful.path], undo)
                with _applying(stateful.path):
                    stateful.obj.load_state_dict(tree)
        if self.dataloader is not None:
            parts = _within(DATALOADER, {n for n in loaded if n.startswith(f"{DATALOADER}/")}, loaded)
            if parts:
                with _applying(DATALOADER):
                    self.dataloader.restore(parts)

    def _loaded_optimizers(self, loaded: dict[str, Any]) -> list[tuple[str, list[_Bound]]]:
        """The optimizers ``loaded`` holds values of (one a ``strict=False`` load did not find saved
        is left as it is)."""
        return [(component, bound) for component, bound in self.optimizers
                if any(name in loaded for item in bound for name in item.names)]

    @staticmethod
    def _takes(stateful: Stateful, loaded: dict[str, Any]) -> bool:
        """Whether the load gives ``stateful`` a state."""
        if stateful.walked:
            return any(name == stateful.path or name.startswith(f"{stateful.path}/") for name in loaded)
        return stateful.path in loaded


@contextmanager
def _applying(name: str) -> Iterator[None]:
    """A failure while giving the component ``name`` its loaded state, as a CheckpointError naming it."""
    try:
        yield
    except CheckpointError as exc:
        exc.key = exc.key or name
        exc.args = (exc._formatted(),)
        raise
    except Exception as exc:
        raise CheckpointError(f"giving it its loaded state raised {type(exc).__name__}: {exc}; the load's changes "
                              "are taken back (with transactional=False, bytes placed as read stay)", key=name) from exc


def _put_back(container: Any, key: Any, previous: Any) -> Callable[[], None]:
    def step() -> None:
        container[key] = previous
    return step


def _state_back(obj: Any, tree: Any) -> Callable[[], None]:
    return lambda: obj.load_state_dict(tree)


def _within(path: str, names: Collection[str], loaded: dict[str, Any]) -> dict[str, Any]:
    cut = len(path) + 1
    return {name[cut:]: loaded[name] for name in names if name in loaded}


def collect(state: Mapping[str, Any], framework: str | None, *, for_load: bool,
            saved_tensors: Mapping[str, Any] | None = None, saved_objects: Collection[str] = (),
            path: str | None = None) -> StateValues:
    """Every value to save or fill, by full name. A load passes the checkpoint's names: every saved
    dataloader part is named (with :data:`SKIP` for those this rank does not read), an optimizer's
    parameters without saved state are left out (their live state is removed by ``apply``), and a
    module or optimizer that an older save stored as one per-rank value is loaded as one."""
    parts = walk(state)
    out = StateValues()
    if for_load:
        parts = _as_saved(parts, saved_objects)
    models = {c.path: c for c in parts.modules}
    for component in parts.modules:
        out.modules.append((component.path, _module_values(out, component, framework, state)))
    for component in parts.optimizers:
        out.optimizers.append((component.path, _optimizer_values(out, component, parts, models, framework, state,
                                                                 for_load, saved_tensors, saved_objects)))
    if out.modules:
        first = next((b for p, b in out.modules if p == MODEL), out.modules[0][1])
        out.framework = first[0].adapter.name
    elif out.optimizers:
        out.framework = out.optimizers[0][1][0].adapter.name
    for leaf in parts.tensors:
        out.add(leaf.path, leaf.container[leaf.key], out.resharded)
    for leaf in parts.plain:
        out.add(leaf.path, leaf.container[leaf.key], out.plain)
    for leaf in parts.values:
        out.add(leaf.path, leaf.container[leaf.key], out.per_rank)
    out.leaves, out.plain_leaves = parts.values, parts.plain
    out.statefuls = parts.statefuls
    for stateful in parts.statefuls:
        if not stateful.walked:
            out.add(stateful.path, stateful.tree, out.per_rank)
    if for_load:
        _want_held_tensors(out, [*saved_tensors, *saved_objects])
    if parts.dataloader is not None:
        out.dataloader = parts.dataloader
        out.values.update(_dataloader_values(parts.dataloader, for_load, saved_objects, path))
    if for_load:
        _check_not_meta(out.values)
    return out


def _want_held_tensors(out: StateValues, saved: list[str]) -> None:
    """Each per-rank value also wants the tensors saved under its name (those it held at the save):
    into the live tensor at the same place in the live value, else read to be placed."""
    under: dict[str, list[str]] = {}
    for name in saved:
        head, _, rest = name.rpartition("/")
        while head:
            if head in out.per_rank:
                under.setdefault(head, []).append(name)
                break
            head, _, rest = head.rpartition("/")
    for value, names in under.items():
        live = dict(tensor_refs(out.values[value], value))
        for name in names:
            out.add(name, live.get(name, PLACED))
        out.held[value] = names


def _as_saved(parts: StateParts, saved_objects: Collection[str]) -> StateParts:
    """A module or optimizer (other than ``model``/``optimizer``) that the checkpoint holds as one
    per-rank value (its ``state_dict()``, as saves did before every module was resharded) is loaded
    from that value."""
    old = set(saved_objects)
    for component in [*parts.modules, *parts.optimizers]:
        objects = component.parts if isinstance(component, ModuleComponent) else component.items
        if component.path not in (MODEL, OPTIMIZER) and component.path in old and len(objects) == 1:
            parts.statefuls.append(Stateful(component.path, objects[0], None, False))
    parts.modules = [c for c in parts.modules if not any(s.path == c.path for s in parts.statefuls)]
    parts.optimizers = [c for c in parts.optimizers if not any(s.path == c.path for s in parts.statefuls)]
    return parts


def _adapter(model: Any, optimizer: Any, framework: str | None, path: str) -> FrameworkAdapter:
    live = {MODEL: model} if optimizer is None else {MODEL: model, OPTIMIZER: optimizer}
    try:
        return adapter_for(live, framework)
    except CheckpointError as exc:
        exc.key = exc.key or path
        exc.args = (exc._formatted(),)
        raise


def _module_values(out: StateValues, component: ModuleComponent, framework: str | None,
                   state: Mapping[str, Any]) -> list[_Bound]:
    chosen = framework if component.path == MODEL else None
    bound = []
    for part in component.parts:
        optimizer = state.get(OPTIMIZER) if component.path == MODEL and isinstance(part, Mapping) else None
        adapter = _adapter(part, optimizer, chosen, component.path)
        item = _Bound(part, part, adapter)
        for key, value in adapter.model_state(part).items():
            out.add(f"{component.path}/{key}", value, out.resharded)
            item.names.add(f"{component.path}/{key}")
        bound.append(item)
    return bound


def _optimizer_values(out: StateValues, component: OptimizerComponent, parts: StateParts,
                      models: dict[str, ModuleComponent], framework: str | None, state: Mapping[str, Any],
                      for_load: bool, saved_tensors: Mapping[str, Any] | None,
                      saved_objects: Collection[str]) -> list[_Bound]:
    prefix = f"{component.path}/"
    merged: dict[str, list[Any]] = {}  # the optimizer values naming parameters, from every item
    bound = []
    for optimizer, explicit in zip(component.items, component.explicit):
        if isinstance(optimizer, Mapping):  # an FQN-keyed state dict: the adapter of state["model"]
            model = state.get(MODEL)
            model = model[0] if isinstance(model, list) and model else model
            adapter = _adapter(model, optimizer, framework, component.path)
        else:
            model = explicit if explicit is not None else _owner(optimizer, parts.modules, component.path)
            adapter = _adapter(model, None, framework if model is _model_of(models) else None, component.path)
        item = _Bound(optimizer, model, adapter)
        values = adapter.optimizer_state(model, optimizer, for_load=for_load)
        if for_load and adapter.optimizer_state_by_parameter:
            values = wanted_as_saved(values, prefix, saved_tensors, saved_objects)
        for key, value in values.items():
            if key in MERGED and adapter.optimizer_state_by_parameter:
                merged.setdefault(key, []).extend(value)
                continue
            out.add(prefix + key, value, out.resharded)
            item.names.add(prefix + key)
        bound.append(item)
    for key, value in merged.items():
        out.add(prefix + key, value, out.merged)
        for item in bound:
            item.names.add(prefix + key)
    return bound


def _model_of(models: dict[str, ModuleComponent]) -> Any:
    component = models.get(MODEL)
    return component.parts[0] if component is not None and len(component.parts) == 1 else None


def _owner(optimizer: torch.optim.Optimizer, modules: list[ModuleComponent], path: str) -> nn.Module:
    """The one module of the state that holds every parameter ``optimizer`` updates; where none
    does, the one holding most of them (the adapter then names the parameters it lacks)."""
    wanted = [id(p) for group in optimizer.param_groups for p in group["params"]]
    held: list[tuple[str, nn.Module, int]] = []
    for component in modules:
        for index, part in enumerate(component.parts):
            if isinstance(part, nn.Module):
                ids = {id(p) for p in part.parameters()}
                where = component.path if len(component.parts) == 1 else f"{component.path}/{index}"
                held.append((where, part, sum(i in ids for i in wanted)))
    holders = [(where, part) for where, part, count in held if count == len(wanted)]
    if len(holders) > 1:
        raise AdapterError(
            f"the optimizer at {path!r} updates parameters held by several modules of the state "
            f"({[where for where, _ in holders]}); name the one that owns them: "
            "bcp.PairedOptimizer(optimizer, module)", key=path)
    best = max(held, key=lambda h: h[2], default=None)
    if best is None or best[2] == 0:
        raise AdapterError(
            f"the optimizer at {path!r} updates parameters that no module of the state holds (modules: "
            f"{[where for where, _, _ in held]}); save the module it updates beside it, or pass "
            "bcp.PairedOptimizer(optimizer, module)", key=path)
    return best[1]


def _check_not_meta(values: dict[str, Any]) -> None:
    """A tensor on the meta device has no memory: loading into it would read and drop every byte."""
    meta = [name for name, value in values.items() if any(t.is_meta for t in _tensors_of(value))]
    if meta:
        raise MismatchError(f"{len(meta)} live tensor(s) are on the meta device and cannot hold loaded values, "
                            f"e.g. {meta[:3]}; materialize the model first (e.g. model.to_empty(device=...))")


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a state-dict value: itself, or the tensors of its shards."""
    if isinstance(value, torch.Tensor):
        return [value]
    shards = value if isinstance(value, (list, tuple)) else [value]
    return [s.tensor for s in shards if isinstance(getattr(s, "tensor", None), torch.Tensor)]


def _dataloader_values(loader: DataloaderState, for_load: bool, saved: Collection[str],
                       path: str | None) -> dict[str, Any]:
    if not for_load:
        return {f"{DATALOADER}/{name}": value for name, value in loader.saved_values().items()}
    prefix = f"{DATALOADER}/"
    names = [name[len(prefix):] for name in saved if name.startswith(prefix)]
    return {prefix + name: loader if read else SKIP for name, read in loader.wanted(names, path).items()}
