"""Tensors held outside modules and optimizers: plain tensors anywhere in a state, and the tensors
that values hold (``layout.values`` extracts them). Each is one of two kinds, decided at every save:

- a *tensor entry*, where every rank that holds its name holds the same bytes (one rank's own
  tensor; DDP replicas): planned as one whole box, written once by one of its holders, listed,
  read and resharded like any tensor;
- a *per-rank tensor*, where ranks' bytes differ: each rank's own, saved as a per-rank value under
  the tensor's name (``docs/resharding.md``: its world-size rules and warnings).

The decision costs one pass over each tensor's bytes, the one the writer would make anyway: the
chunk checksums computed here are those the writer stores for a tensor entry. Folded with the
dtype and shape into 8 bytes, they travel with the save's plan exchange; two ranks' tensors count
as the same where every chunk's crc32c agrees (differing bytes escape that with a chance of 2**-32
per differing chunk). A per-rank tensor's record is checksummed again as it is written (its chunks
begin after the record's tree, not with the tensor): a second pass, paid only by tensors that
differ across ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.engine.checksum import chunk_crcs, content_digest
from bcp.engine.chunked_copies import ChunkedCopies
from bcp.errors import UnsupportedValueError
from bcp.layout.dtypes import dtype_name
from bcp.layout.values import encode_value
from bcp.layout.write_plan import ValueWrite

#: ``[name, digest]`` of each tensor a rank holds, as the plan exchange carries them.
Digests = list[list[Any]]


@dataclass(slots=True)
class PlainTensor:
    """Tensor ``name`` of this rank: ``tensor`` is what its bytes are written from (the tensor
    itself where it is contiguous, in host or device memory; else a contiguous host copy), ``crcs``
    their chunk checksums."""

    name: str
    tensor: torch.Tensor
    crcs: list[int]
    digest: int

    @staticmethod
    def of(name: str, tensor: torch.Tensor, chunk: int, copies: ChunkedCopies) -> "PlainTensor":
        """Checksummed where it lies: a tensor in accelerator memory through ``copies``' pinned
        chunks (a few chunks of host memory, not a host copy of the tensor)."""
        if tensor.layout != torch.strided:
            raise UnsupportedValueError("sparse and non-strided tensors are not supported", key=name)
        tensor = tensor.detach().resolve_conj().resolve_neg()
        if copies.holds(tensor):
            crcs = _streamed_crcs(tensor, chunk, copies)
        else:
            tensor = host_contiguous(tensor)
            crcs = chunk_crcs(byte_view(tensor), chunk)
        return PlainTensor(name, tensor, crcs, content_digest(crcs, dtype_name(tensor.dtype), tuple(tensor.shape)))


def _streamed_crcs(tensor: torch.Tensor, chunk: int, copies: ChunkedCopies) -> list[int]:
    crcs: list[int] = []
    for _, view in copies.write_views([tensor], multiple_of=chunk, reused_from=0):
        crcs.extend(chunk_crcs(view, chunk))  # each view but the last is a whole number of chunks
    return crcs


def digests(tensors: list[PlainTensor]) -> Digests:
    return [[t.name, t.digest] for t in tensors]


def same_everywhere(every_rank: list[Digests]) -> set[str]:
    """The names whose holders all hold the same bytes: the tensor entries (the same on every rank)."""
    seen: dict[str, set[int]] = {}
    for pairs in every_rank:
        for name, digest in pairs:
            seen.setdefault(name, set()).add(digest)
    return {name for name, found in seen.items() if len(found) == 1}


def kinds_digest(entries: set[str]) -> int:
    """8 bytes naming which tensors are tensor entries: a cached save plan holds for a save only
    where its tensors are of the same kinds."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(entries):
        h.update(name.encode() + b"\0")
    return int.from_bytes(h.digest(), "big")


def per_rank_value(tensor: PlainTensor) -> ValueWrite:
    """A per-rank tensor's record (the value encoding of a tensor), written from its own memory
    where that is host memory."""
    return ValueWrite.of(tensor.name, encode_value(tensor.tensor, key=tensor.name), digest=tensor.digest)
