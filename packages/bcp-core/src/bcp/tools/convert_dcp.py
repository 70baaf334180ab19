"""``bcp convert`` between PyTorch Distributed Checkpoint (DCP) folders and bcp checkpoints.

DCP's metadata (and every non-tensor value in it) is a Python pickle, and unpickling a hostile
file runs arbitrary code: reading DCP is refused unless the caller states that it trusts the
source (``trust_pickle``). Nothing else in bcp unpickles. Both directions go through DCP's own
reader and writer (so its format details stay DCP's business) one tensor at a time, so memory
holds about one tensor however large the checkpoint is.

Names: DCP flattens nested state dicts; the path of keys it records for each entry maps to bcp
names as ``bcp.save`` names a state's parts. Every tensor is a resharded entry, whatever its key:
``("model", fqn)`` <-> ``model/<fqn>``, any other path of keys ``(a, b, c)`` <-> ``a/b/c`` (a
module's state dict under ``ema``: ``ema/<fqn>``; an optimizer's under ``opt``:
``opt/state/<fqn>/<key>``; a tensor nested in dicts and lists). An optimizer state dict (a key
holding ``param_groups``, and ``optimizer``) keeps its groups as the value ``<key>/param_groups``
and a non-tensor state entry as ``<key>/state/<fqn>/<key>``; any other non-tensor is part of the
value ``<component>``. A top-level tensor (``dcp.save(model.state_dict())``) becomes ``model/<fqn>``.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Iterator

import torch

from bcp.chunk_codecs import Compression
from bcp.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_from_name
from bcp.tools.build import PieceSource, ValueSource, write_checkpoint
from bcp.tools.checkpoint import Checkpoint, open_checkpoint
from bcp.tools.paths import check_new_local_output
from bcp.tools.progress import NoProgress, Progress
from bcp.tools.rules import CastRules, NameRules

Path = tuple[Any, ...]


@dataclass
class DcpConvertResult:
    out: str
    tensors: int
    values: int
    #: Per-rank values of which DCP keeps one (rank 0's): names.
    reduced_to_rank0: list[str] = field(default_factory=list)


def convert_dcp_to_bcp(src: "str | os.PathLike", out: "str | os.PathLike", *, trust_pickle: bool = False,
                       rules: NameRules = NameRules(), casts: CastRules = CastRules(),
                       compression: "Compression | str | bool | None" = None, progress: Progress | None = None) -> DcpConvertResult:
    """Convert the DCP checkpoint folder ``src`` into a new bcp checkpoint at ``out``.

    ``trust_pickle`` must be True: DCP metadata is a pickle, so reading it can run code.
    ``rules`` and ``casts`` patterns see bcp names (``model/<fqn>``, ...). ``compression``: the
    codec the data is stored with (None: uncompressed), as ``bcp.save`` takes it.
    """
    source = DcpSource(src, trust_pickle=trust_pickle)
    tensors: dict[str, str] = {}  # bcp name -> DCP key
    value_keys: dict[str, list[tuple[str, Path]]] = {}  # bcp name -> [(DCP key, path inside the value)]
    optimizers = optimizer_keys(path for _, path in source.paths())
    holding = holding_tensors(path for key, path in source.paths() if source.is_tensor(key))
    for key, path in source.paths():
        name, inner = bcp_name(path, is_tensor=source.is_tensor(key), optimizers=optimizers, holding=holding)
        if source.is_tensor(key) and not inner:
            tensors[name] = key
        else:
            value_keys.setdefault(name, []).append((key, inner))
    names = rules.apply([*tensors, *value_keys])
    pieces = []
    for name, key in tensors.items():
        if name in names:
            meta = source.tensor_meta(key)
            dtype = casts.dtype_for(name, meta.properties.dtype)
            shape = tuple(meta.size)
            pieces.append(PieceSource(names[name], dtype, shape, Box.whole(shape),
                                      lambda key=key, dtype=dtype: source.read_tensor(key).to(dtype)))
    kept = {name: parts for name, parts in value_keys.items() if name in names}
    loaded = source.read_values([key for parts in kept.values() for key, _ in parts])
    values = []
    for name, parts in kept.items():
        tree: dict[str, Any] = {}
        for key, inner in parts:
            insert(tree, ("value", *inner), loaded[key])
        values.append(_encoded(names[name], tree["value"]))
    write_checkpoint(out, pieces, values, note="converted from DCP", sources=[src], compression=compression,
                     progress=progress)
    return DcpConvertResult(os.fspath(out), len(pieces), len(values))


def convert_bcp_to_dcp(src: "str | os.PathLike", out: "str | os.PathLike", *, role: str | None = None,
                       allow_pickle: bool = False, progress: Progress | None = None) -> DcpConvertResult:
    """Write the checkpoint at ``src`` as a DCP checkpoint folder ``out`` (one file per entry, every
    tensor whole). DCP keeps one copy of each non-tensor value: a per-rank value is rank 0's."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    checkpoint = open_checkpoint(src, role=role)
    target = check_new_local_output(out, [checkpoint.location.storage.root], what="DCP checkpoints")
    state: dict[str, Any] = {}
    placeholders: dict[int, str] = {}
    metas: dict[str, torch.Tensor] = {}
    for name, entry in checkpoint.tensors.items():
        metas[name] = meta = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
        placeholders[id(meta)] = name
        if checkpoint.manifest.holder_of(name) is None:  # else it goes in with the value holding it
            insert(state, tuple(name.split("/")), meta)
    reduced = []
    for name, entry in checkpoint.objects.items():
        if checkpoint.manifest.holder_of(name) is not None:
            continue  # a per-rank tensor of a value: read with it
        rank = next(r for r, record in enumerate(entry.ranks) if record >= 0)
        value = checkpoint.read_object(name, rank=rank, allow_pickle=allow_pickle,
                                       resolve=checkpoint.held_tensors(rank, allow_pickle=allow_pickle, known=metas))
        insert(state, tuple(name.split("/")), value)
        if len(entry.records) > 1:
            reduced.append(name)
    progress = progress or NoProgress()
    progress.start("convert", checkpoint.manifest.total_tensor_bytes())
    planner = _lazy_planner(checkpoint, placeholders, progress)
    try:
        with _single_process():
            save(state, storage_writer=FileSystemWriter(target, single_file_per_rank=False), planner=planner,
                 no_dist=True)
    finally:
        progress.finish()
    return DcpConvertResult(target, len(checkpoint.tensors), len(checkpoint.objects), reduced)


class DcpSource:
    """A DCP checkpoint folder opened for reading one entry at a time (metadata unpickled once)."""

    def __init__(self, path: "str | os.PathLike", *, trust_pickle: bool) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = os.fspath(path)
        if not trust_pickle:
            raise UnsafeCheckpointError(
                "DCP checkpoint metadata is a Python pickle, and unpickling a file can run arbitrary code; "
                "pass trust_pickle=True (--trust-pickle) only for a checkpoint you trust", path=self.path)
        if not os.path.isfile(os.path.join(self.path, ".metadata")):
            raise CheckpointNotFoundError("not a DCP checkpoint (no .metadata file)", path=self.path)
        try:
            metadata = FileSystemReader(self.path).read_metadata()
        except Exception as exc:  # a damaged pickle can raise nearly anything
            raise CorruptCheckpointError(f"unreadable DCP metadata ({type(exc).__name__}: {exc})",
                                         path=self.path) from None
        self.metadata = metadata

        class _Reader(FileSystemReader):  # every load reads the metadata: unpickle it once, not per tensor
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return metadata

        self.reader = _Reader(self.path)

    def paths(self) -> Iterator[tuple[str, Path]]:
        """Every entry's DCP key and path of nested keys (the key itself when DCP did not flatten)."""
        mappings = self.metadata.planner_data or {}
        for key in self.metadata.state_dict_metadata:
            yield key, tuple(mappings.get(key, (key,)))

    def is_tensor(self, key: str) -> bool:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return isinstance(self.metadata.state_dict_metadata[key], TensorStorageMetadata)

    def tensor_meta(self, key: str) -> Any:
        return self.metadata.state_dict_metadata[key]

    def read_tensor(self, key: str) -> torch.Tensor:
        meta = self.tensor_meta(key)
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        return self._load({key: out}, key)[key]

    def read_values(self, keys: list[str]) -> dict[str, Any]:
        """Non-tensor entries (and tensors that live inside values), all in one read: they are small."""
        wanted = {k: torch.empty(tuple(self.tensor_meta(k).size), dtype=self.tensor_meta(k).properties.dtype)
                  if self.is_tensor(k) else None for k in keys}
        return self._load(wanted, ", ".join(keys[:3])) if wanted else {}

    def _load(self, state: dict[str, Any], what: str) -> dict[str, Any]:
        from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, load

        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        try:
            with _single_process():
                load(state, storage_reader=self.reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP wraps storage errors in a BaseException
            raise CorruptCheckpointError(f"reading {what} failed: {type(exc).__name__}: {exc}",
                                         path=self.path) from None
        return state


def _lazy_planner(checkpoint: Checkpoint, placeholders: dict[int, str], progress: Progress) -> Any:
    """DCP's default save planner, except that tensor data is read from the bcp checkpoint only when
    DCP writes it (planning sees meta tensors), so one tensor is in memory at a time."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            value = super().lookup_object(index)
            name = placeholders.get(id(value))
            if name is None:
                return value
            tensor = checkpoint.read(name)
            progress.advance(tensor.numel() * tensor.element_size())
            return tensor

    return LazySavePlanner()


def optimizer_keys(paths: Iterable[Path]) -> set[str]:
    """The top-level keys holding an optimizer state dict (``state`` and ``param_groups``)."""
    return {"optimizer"} | {str(path[0]) for path in paths if len(path) > 1 and path[1] == "param_groups"}


def holding_tensors(tensor_paths: Iterable[Path]) -> set[Path]:
    """Every dict or list (by its path of keys) with a tensor somewhere inside."""
    return {path[:i] for path in tensor_paths for i in range(1, len(path))}


def bcp_name(path: Path, *, is_tensor: bool, optimizers: Collection[str] = ("optimizer",),
             holding: Collection[Path] = frozenset()) -> tuple[str, Path]:
    """The bcp entry a DCP path belongs to, and the path of the leaf inside that entry's value
    (empty for a tensor: every tensor is an entry of its own). As ``bcp.save`` walks a state, a
    non-tensor belongs to the value of the outermost dict or list on its path that holds no tensor."""
    head = str(path[0])
    if len(path) == 1:
        return (f"model/{head}" if is_tensor else head), ()
    if head == "model":
        return "model/" + ".".join(str(p) for p in path[1:]), ()
    if head in optimizers and path[1] == "state" and len(path) >= 4:
        return f"{head}/state/{path[2]}/{path[3]}", tuple(path[4:])
    if head in optimizers:
        return f"{head}/{path[1]}", tuple(path[2:])
    if is_tensor:
        return "/".join(str(p) for p in path), ()
    depth = 1
    while depth < len(path) and path[:depth] in holding:
        depth += 1
    return "/".join(str(p) for p in path[:depth]), tuple(path[depth:])


def insert(tree: dict[str, Any], path: Path, value: Any) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating dicts (for names) and lists (for indices)."""
    node: Any = tree
    for step, following in zip(path, path[1:]):
        if isinstance(node, list):
            while len(node) <= step:
                node.append(None)
        child = node[step] if isinstance(node, list) else node.get(step)
        if child is None:
            child = [] if isinstance(following, int) else {}
            node[step] = child
        elif not isinstance(child, (dict, list)):
            raise CheckpointError(f"entry {'/'.join(map(str, path))!r} lies inside another entry's value")
        node = child
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    elif last in node:
        raise CheckpointError(f"entry {'/'.join(map(str, path))!r} would replace another entry")
    node[last] = value


def _encoded(name: str, value: Any) -> ValueSource:
    try:
        return ValueSource.of(name, value)
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(f"{exc}. bcp stores values in a safe encoding only; leave this entry out "
                                    "with a drop rule (--drop)", key=name) from None


@contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it runs without collectives; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
