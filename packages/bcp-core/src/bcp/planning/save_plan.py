"""Save planning: local plans (what each rank holds) -> a global plan (who writes what).

Replicated data is written once: identical boxes of a tensor on several ranks are replicas, and
each is given to the replica-holding rank with the fewest bytes so far, largest first (worst-fit,
paper section 4.1); a very large replicated box is cut along its first dimension so that several
of its holders write a part each. The coordinator also checks that ranks agree on every tensor's
dtype and global shape and that the pieces cover every tensor exactly (``layout.coverage``).

Pieces travel and are planned as integer columns (numpy), so planning is a few sorts and array
passes over all pieces: linear-logarithmic in their number, with Python loops only over tensors
and over boxes that several ranks hold.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from bcp.engine.bytes_of import byte_view
from bcp.engine.checksum import crc_of
from bcp.errors import MismatchError
from bcp.layout.coverage import first_cover_problem
from bcp.layout.dtypes import dtype_from_name, itemsize
from bcp.layout.box import Box
from bcp.layout.local_plan import LocalPlan
from bcp.layout.manifest import DEFAULT_CHECKSUM_CHUNK
from bcp.layout.piece import Piece, pad_columns
from bcp.layout.write_plan import PieceWrite, RankAssignment, SplitPart

# A replicated box larger than this is split between the ranks that hold it.
SPLIT_BYTES = 256 << 20


def structure_key(tensors: list[tuple[str, Any, tuple[int, ...]]], pieces: list[Piece]) -> tuple:
    """Everything a local plan depends on, as plain tuples compared exactly: equal keys give equal
    local plans. Building it costs a fraction of building the plan, which a cache hit skips."""
    return tuple(tensors), [(p.name, p.box.offsets, p.box.lengths) for p in pieces]


@functools.lru_cache(maxsize=None)
def itemsize_of(name: str) -> int:
    return itemsize(dtype_from_name(name))


class PlanColumns:
    """Every rank's pieces as one set of columns, tensors numbered globally (in order of first
    declaration, rank by rank). Rank r's pieces are rows ``starts[r]:starts[r + 1]``, in its
    local plan's order. Built once per plan on the coordinating rank, and kept with a cached plan
    to assemble each save's manifest."""

    def __init__(self, local_plans: list[LocalPlan]) -> None:
        self.names: list[str] = []
        self.dtypes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        ids: dict[str, int] = {}
        first_rank: list[int] = []
        tensor, offsets, lengths, rank, local, crcs = [], [], [], [], [], []
        self.ndim = max([plan.ndim for plan in local_plans], default=0)
        for r, plan in enumerate(local_plans):
            declared = plan.tensors
            to_global = np.empty(len(declared), dtype=np.int64)
            for i, (name, dtype, shape) in enumerate(declared):
                gid = ids.get(name)
                if gid is None:
                    gid = ids[name] = len(self.names)
                    self.names.append(name)
                    self.dtypes.append(dtype)
                    self.shapes.append(tuple(shape))
                    first_rank.append(r)
                elif (self.dtypes[gid], self.shapes[gid]) != (dtype, tuple(shape)):
                    raise MismatchError(
                        f"ranks disagree on the tensor: rank {first_rank[gid]} has {self.dtypes[gid]} "
                        f"{list(self.shapes[gid])}, rank {r} has {dtype} {list(shape)}", key=name)
                to_global[i] = gid
            tensor.append(to_global[plan.tensor])
            offsets.append(pad_columns(plan.offsets, self.ndim, 0))
            lengths.append(pad_columns(plan.lengths, self.ndim, 1))
            rank.append(np.full(len(plan), r, dtype=np.int64))
            local.append(np.arange(len(plan), dtype=np.int64))
            if plan.replica_crcs is not None:
                crcs.append(plan.replica_crcs)
        empty = np.zeros(0, dtype=np.int64)
        self.tensor = np.concatenate(tensor) if tensor else empty
        self.offsets = np.concatenate(offsets) if offsets else empty.reshape(0, self.ndim)
        self.lengths = np.concatenate(lengths) if lengths else empty.reshape(0, self.ndim)
        self.rank = np.concatenate(rank) if rank else empty
        self.local = np.concatenate(local) if local else empty
        self.crcs = np.concatenate(crcs) if len(crcs) == len(local_plans) and crcs else None
        self.starts = np.concatenate([[0], np.cumsum([len(t) for t in tensor])]).astype(np.int64)
        self.itemsize = np.array([itemsize_of(d) for d in self.dtypes], dtype=np.int64)


def global_plan(p: PlanColumns, split_bytes: int | None = None) -> list[RankAssignment]:
    """For each rank, the pieces it writes: whole local pieces, and parts of split replicated pieces
    (boxes over ``split_bytes``, default ``SPLIT_BYTES``)."""
    split_bytes = split_bytes or SPLIT_BYTES
    keys = np.concatenate([p.tensor[:, None], p.offsets, p.lengths], axis=1)
    distinct, first, inverse = _unique_rows(keys)
    counts = np.bincount(inverse, minlength=len(distinct))
    gid = distinct[:, 0]
    offsets, lengths = distinct[:, 1:1 + p.ndim], distinct[:, 1 + p.ndim:]
    nbytes = np.prod(lengths, axis=1) * p.itemsize[gid]

    if p.crcs is not None:
        _check_replicas_agree(p, first, inverse)
    _check_coverage(p, gid, offsets, lengths)

    world = len(p.starts) - 1
    load = np.zeros(world, dtype=np.int64)
    writes = [RankAssignment() for _ in range(world)]
    single = counts == 1
    single_rows = first[single]
    np.add.at(load, p.rank[single_rows], nbytes[single])
    for r, index in zip(p.rank[single_rows].tolist(), p.local[single_rows].tolist()):
        writes[r].whole.append(index)

    # Boxes held by several ranks: largest first, each to its least loaded holder.
    by_box = np.argsort(inverse, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)])
    for box in np.flatnonzero(~single)[np.argsort(-nbytes[~single], kind="stable")].tolist():
        rows = by_box[starts[box]:starts[box + 1]]
        holders = p.rank[rows]
        size = int(nbytes[box])
        rows_dim0 = int(lengths[box, 0]) if p.shapes[gid[box]] else 1
        parts = min(len(rows), -(-size // split_bytes), rows_dim0)
        if parts <= 1:
            pick = int(np.argmin(load[holders]))
            load[holders[pick]] += size
            writes[int(holders[pick])].whole.append(int(p.local[rows[pick]]))
            continue
        ndim = len(p.shapes[gid[box]])
        chosen = np.argsort(load[holders], kind="stable")[:parts]
        aligned = DEFAULT_CHECKSUM_CHUNK // math.gcd(DEFAULT_CHECKSUM_CHUNK, size // rows_dim0)
        for pick, (start, count) in zip(chosen.tolist(), _split_rows(rows_dim0, parts, aligned)):
            sub_offsets = offsets[box, :ndim].tolist()
            sub_lengths = lengths[box, :ndim].tolist()
            sub_offsets[0] += start
            sub_lengths[0] = count
            load[holders[pick]] += size * count // rows_dim0
            part = SplitPart(int(p.local[rows[pick]]), tuple(sub_offsets), tuple(sub_lengths))
            writes[int(holders[pick])].parts.append(part)
    return writes


def _unique_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct rows, the index of each one's first occurrence, and each row's distinct index.
    Rows are grouped by a 64-bit hash (one fast sort); a collision, checked for, falls back to an
    exact row sort."""
    if len(keys) == 0:
        return keys, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    mix = np.arange(1, keys.shape[1] + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) | np.uint64(1)
    with np.errstate(over="ignore"):
        hashed = keys.astype(np.uint64) * mix
        hashed ^= hashed >> np.uint64(29)
        hashed = np.bitwise_xor.reduce(hashed * np.uint64(0xBF58476D1CE4E5B9), axis=1)
    _, first, inverse = np.unique(hashed, return_index=True, return_inverse=True)
    if not np.array_equal(keys[first[inverse]], keys):
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    return keys[first], first, inverse.reshape(-1)


def _split_rows(rows: int, parts: int, aligned: int) -> list[tuple[int, int]]:
    """``parts`` runs of rows, as even as they can be while each cut falls on a multiple of
    ``aligned`` rows (a checksum-chunk boundary, so a part's checksums are a slice of the whole
    piece's where those were computed already), or evenly where the rows are too few for that."""
    unit = aligned if rows // aligned >= parts else 1
    base, extra = divmod(rows // unit, parts)
    bounds, start = [], 0
    for i in range(parts):
        count = (base + (1 if i < extra else 0)) * unit
        if i == parts - 1:
            count = rows - start
        bounds.append((start, count))
        start += count
    return bounds


def _check_replicas_agree(p: PlanColumns, first: np.ndarray, inverse: np.ndarray) -> None:
    differs = p.crcs != p.crcs[first[inverse]]
    if np.any(differs):
        row = int(np.flatnonzero(differs)[0])
        box = first[inverse[row]]
        ndim = len(p.shapes[p.tensor[row]])
        raise MismatchError(
            f"replicas of box offsets={p.offsets[row, :ndim].tolist()} lengths={p.lengths[row, :ndim].tolist()} "
            f"differ between ranks {int(p.rank[box])} and {int(p.rank[row])}", key=p.names[p.tensor[row]])


def _check_coverage(p: PlanColumns, gid: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """The distinct boxes of every tensor cover it exactly (replicas were merged into one box)."""
    problem = first_cover_problem(p.shapes, gid, offsets, lengths)
    if problem is not None:
        raise MismatchError(f"the ranks' pieces do not cover the tensor (global shape {list(p.shapes[problem.tensor])}) "
                            f"exactly: {problem.describe()}; every element must be held by exactly one rank or by "
                            "identical replicas", key=p.names[problem.tensor])


def writes_of(pieces: list[Piece], assignment: RankAssignment,
              crcs: list[list[int] | None] | None = None) -> list[PieceWrite]:
    """A rank's assignment resolved to the tensors it writes (views of its pieces, no copy);
    ``crcs``, where given, are each piece's chunk checksums already computed."""
    out = [PieceWrite.of(index, None, pieces[index].tensor, crcs[index] if crcs else None)
           for index in assignment.whole]
    for part in assignment.parts:
        piece = pieces[part.index]
        region = Box(part.offsets, part.lengths).relative_to(piece.box)
        tensor = piece.tensor[region.slices()]
        known = crcs[part.index] if crcs else None
        out.append(PieceWrite.of(part.index, part, tensor, known and _part_crcs(known, piece, region, tensor)))
    return out


def _part_crcs(crcs: list[int], piece: Piece, region: Box, part: torch.Tensor) -> list[int] | None:
    """The chunk checksums of a part (a run of rows of a contiguous piece) out of the piece's own,
    where the part starts on a chunk boundary (``_split_rows`` cuts there when it can); only a
    last chunk that the part shares with the next is checksummed again."""
    chunk = DEFAULT_CHECKSUM_CHUNK
    nbytes = part.numel() * part.element_size()
    start = region.offsets[0] * (piece.nbytes // max(1, piece.box.lengths[0])) if region.offsets else 0
    if start % chunk or not piece.tensor.is_contiguous():
        return None
    first, whole = start // chunk, nbytes // chunk
    if start + nbytes == piece.nbytes:  # the piece's last part: its last chunk is the piece's
        return crcs[first:]
    tail = [] if nbytes % chunk == 0 else \
        [crc_of(byte_view(piece.tensor.reshape(-1).view(torch.uint8)[start + whole * chunk: start + nbytes]))]
    return crcs[first:first + whole] + tail
