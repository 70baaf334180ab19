"""``bcp edit``: a new checkpoint from an existing one with entries renamed or dropped and tensors
cast, shard by shard (or tensor by tensor with ``consolidate``); the source is only read. And
``remove_entries``, the same rewrite into the checkpoint itself (Megatron's pruning of keys)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

from bcp.chunk_codecs import Compression
from bcp.engine.location import Location
from bcp.errors import MismatchError
from bcp.layout.box import Box
from bcp.layout.dtypes import dtype_from_name
from bcp.layout.manifest import Manifest, TensorEntry
from bcp.tools.build import PieceSource, ValueSource, write_checkpoint
from bcp.tools.checkpoint import Checkpoint, open_checkpoint
from bcp.tools.progress import Progress
from bcp.tools.rules import CastRules, NameRules
from bcp.tools.stored_copy import copy_stored


#: ``compression`` of :func:`edit_checkpoint` and :func:`copy_checkpoint`: store the data as the
#: source does (compressed with its codec, or not).
SOURCE = "source"


@dataclass
class EditResult:
    out: str
    generation: int
    tensors: int
    values: int
    dropped: int


def edit_checkpoint(src: "str | os.PathLike", out: "str | os.PathLike", *, role: str | None = None,
                    rules: NameRules = NameRules(), casts: CastRules = CastRules(), consolidate: bool = False,
                    compression: "Compression | str | bool | None" = SOURCE, progress: Progress | None = None,
                    generation: int | None = None) -> EditResult:
    """Write the checkpoint at ``src`` (its newest committed generation, or ``generation``), edited,
    as a new checkpoint at ``out``, which refers to nothing outside it.

    ``rules`` and ``casts`` patterns see full names (``model/<fqn>``, ``optimizer/state/...``).
    Shards keep their boxes (memory: one shard at a time) unless ``consolidate`` writes every
    tensor as one whole piece (memory: one tensor at a time). Per-rank values are kept per rank.
    Tensors that shared stored bytes (tied weights) still share them. ``compression``: the codec
    the data is stored with (a name, as ``bcp.save`` takes it; None: uncompressed; by default the
    source's). The raw bytes' checksums stay the same whatever the codec.
    """
    return _edit(open_checkpoint(src, role=role, generation=generation), out, rules=rules, casts=casts,
                 consolidate=consolidate, compression=compression, progress=progress)


def copy_checkpoint(src: "str | os.PathLike", out: "str | os.PathLike", *, role: str | None = None,
                    generation: int | None = None, compression: "Compression | str | bool | None" = SOURCE,
                    progress: Progress | None = None) -> EditResult:
    """Copy one generation of ``src`` (the newest committed one, or ``generation``) to ``out`` as a
    checkpoint of its own: every byte it uses is read (checked against its checksum) and written
    anew, those an incremental save left in earlier generations included, so the copy refers to
    nothing outside ``out``. The copy's shards, values and tied tensors are the source's, and by
    default its stored bytes too (compressed chunks are copied as stored, not compressed again);
    ``compression`` other than :data:`SOURCE` stores the data with that codec (None: uncompressed)."""
    checkpoint = open_checkpoint(src, role=role, generation=generation)
    if compression != SOURCE:
        return _edit(checkpoint, out, rules=NameRules(), casts=CastRules(), consolidate=False,
                     compression=compression, progress=progress)
    written = copy_stored(checkpoint, out, sources=[checkpoint.location.storage.root], progress=progress)
    manifest = checkpoint.manifest
    return EditResult(os.fspath(out), written, len(manifest.tensors), len(manifest.objects), 0)


def remove_entries(path: "str | os.PathLike", names: Iterable[str], *, role: str | None = None,
                   progress: Progress | None = None) -> EditResult:
    """Remove the entries ``names`` (tensors or values, full names) from the checkpoint at ``path``,
    their stored bytes included: the only tool that changes its input.

    The rest is rewritten as a new generation of ``path``, as saved (shards, per-rank values, shared
    bytes); once it is committed every older generation is removed. Interrupted before that commit,
    the checkpoint is the unedited one; after it, the edited one (the next save's retention removes
    the older generations left). Not while another process saves to ``path``.
    """
    checkpoint = open_checkpoint(path, role=role)
    manifest = checkpoint.manifest
    removed = set(names)
    unknown = sorted(removed - manifest.tensors.keys() - manifest.objects.keys())
    if unknown:
        raise MismatchError(f"cannot remove {', '.join(map(repr, unknown))}: no such entry", path=checkpoint.path)
    kept = {name: name for name in [*manifest.tensors, *manifest.objects] if name not in removed}
    kept = _with_holders(manifest, kept, checkpoint.path)
    return _write_edited(checkpoint, kept, replace(checkpoint.location, keep_generations=1), casts=CastRules(),
                         consolidate=False, compression=_compression_of(manifest), progress=progress, sources=())


def _edit(checkpoint: Checkpoint, out: "str | os.PathLike", *, rules: NameRules, casts: CastRules,
          consolidate: bool, compression: "Compression | str | bool | None", progress: Progress | None) -> EditResult:
    manifest = checkpoint.manifest
    names = _with_holders(manifest, rules.apply([*manifest.tensors, *manifest.objects]), checkpoint.path)
    return _write_edited(checkpoint, names, out, casts=casts, consolidate=consolidate,
                         compression=_compression_of(manifest) if compression == SOURCE else compression,
                         progress=progress, sources=[checkpoint.location.storage.root])


def _compression_of(manifest: Manifest) -> Compression | None:
    """The compression the checkpoint was saved with (None: uncompressed)."""
    return manifest.compression


def _with_holders(manifest: Manifest, names: dict[str, str], path: str) -> dict[str, str]:
    """The tensors a value holds (saved under its name, ``layout.values``) go where the value goes:
    dropped and renamed with it. Dropped or renamed apart from it, they would leave the value
    referring to nothing, which is refused."""
    out = dict(names)
    for name in [*manifest.tensors, *manifest.objects]:
        holder = manifest.holder_of(name)
        if holder is None:
            continue
        if holder not in names:
            out.pop(name, None)
            continue
        follows = names[holder] + name[len(holder):]
        if names.get(name) not in (name, follows):
            what = "dropped" if name not in names else f"renamed to {names[name]!r}"
            raise MismatchError(f"{name!r} would be {what} apart from the value {holder!r} that holds it; "
                                f"edit {holder!r} instead (its tensors follow it)", path=path)
        out[name] = follows
    return out


def _write_edited(checkpoint: Checkpoint, names: dict[str, str], out: "str | os.PathLike | Location", *,
                  casts: CastRules, consolidate: bool, compression: "Compression | str | bool | None", progress: Progress | None,
                  sources: Sequence[str]) -> EditResult:
    """Write the entries ``names`` (source name -> new name) of ``checkpoint`` to ``out``."""
    manifest = checkpoint.manifest
    pieces: list[PieceSource] = []
    aliases: dict[str, str] = {}
    written: dict[tuple, str] = {}  # stored bytes and target dtype -> new name of the tensor written from them
    for name, entry in manifest.tensors.items():
        if name not in names:
            continue
        dtype = casts.dtype_for(name, dtype_from_name(entry.dtype))
        stored = (tuple((s.box, s.bytes) for s in entry.shards), dtype)
        if stored in written:
            aliases[names[name]] = written[stored]
            continue
        written[stored] = names[name]
        pieces.extend(_pieces(checkpoint, entry, names[name], dtype, consolidate))
    values = [_copied(checkpoint, name, names[name]) for name in manifest.objects if name in names]
    generation = write_checkpoint(
        out, pieces, values, note="edited", framework=manifest.framework, world_size=manifest.world_size,
        aliases=aliases, unsafe_pickle=manifest.unsafe_pickle, sources=sources, compression=compression,
        progress=progress)
    kept = len(written) + len(aliases)
    return EditResult(out.display if isinstance(out, Location) else os.fspath(out), generation, kept, len(values),
                      len(manifest.tensors) + len(manifest.objects) - kept - len(values))


def _pieces(checkpoint: Checkpoint, entry: TensorEntry, new_name: str, dtype: torch.dtype,
            consolidate: bool) -> list[PieceSource]:
    boxes = [s.box for s in entry.shards] if entry.shards and not consolidate else [Box.whole(entry.shape)]
    return [PieceSource(new_name, dtype, entry.shape, box,
                        lambda box=box: checkpoint.read_box(entry.name, box).to(dtype))
            for box in boxes]


def _copied(checkpoint: Checkpoint, name: str, new_name: str) -> ValueSource:
    """A value's records as stored (verified on read), under its new name."""
    entry = checkpoint.objects[name]
    records = []
    for where, tree_nbytes in entry.records:
        data = bytearray(where.nbytes)
        checkpoint.read_range(where, 0, memoryview(data), name)
        records.append((bytes(data), tree_nbytes))
    return ValueSource(new_name, records, list(entry.ranks), refs=checkpoint.manifest.version >= 2)
