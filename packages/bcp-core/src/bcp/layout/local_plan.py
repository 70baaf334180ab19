"""A rank's local save plan: the tensors it declares and the pieces it holds, as integer columns.

It is what every rank sends the coordinator when a save is planned (paper section 3.3, step 1), so
it packs itself into plain data (bytes columns): at thousands of ranks the coordinator unpacks
millions of pieces with a few array operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bcp.layout.dtypes import dtype_name
from bcp.layout.piece import NamedBox, box_columns

#: A declared tensor: name, dtype name (``layout.dtypes``) and global shape (a tuple, or the list
#: it unpacks as: at thousands of ranks the coordinator does not convert every declaration).
TensorDeclaration = Sequence[Any]


@dataclass(slots=True)
class LocalPlan:
    """``tensors`` declares every tensor the rank has, pieces or not (an empty shard still names its
    tensor). Piece ``i`` is box ``offsets[i]``/``lengths[i]`` (``ndim`` columns, padded with 0 and
    1) of tensor ``tensors[tensor[i]]``; ``replica_crcs`` (uint32, for the replica check only) is
    the crc32c of each piece's bytes."""

    tensors: list[TensorDeclaration]
    ndim: int
    tensor: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    replica_crcs: np.ndarray | None = None

    @staticmethod
    def of(tensors: list[tuple[str, Any, tuple[int, ...]]], pieces: Sequence[NamedBox],
           replica_crcs: list[int] | None = None) -> "LocalPlan":
        """The plan of ``pieces`` of the declared ``tensors`` (name, torch dtype, global shape)."""
        index = {name: i for i, (name, _, _) in enumerate(tensors)}
        ndim = max([len(p.box.offsets) for p in pieces], default=0)
        offsets, lengths = box_columns(pieces, ndim)
        return LocalPlan([(n, dtype_name(d), tuple(s)) for n, d, s in tensors], ndim,
                         np.array([index[p.name] for p in pieces], dtype=np.int64), offsets, lengths,
                         np.array(replica_crcs, dtype=np.uint32) if replica_crcs is not None else None)

    def __len__(self) -> int:
        return len(self.tensor)

    #: The layout of :meth:`to_wire`: each field by name, the columns as their bytes.
    VERSION = 1

    def to_wire(self) -> dict[str, Any]:
        crcs = self.replica_crcs.tobytes() if self.replica_crcs is not None else None
        return {"version": self.VERSION, "tensors": [[n, d, list(s)] for n, d, s in self.tensors], "ndim": self.ndim,
                "tensor": self.tensor.tobytes(), "offsets": self.offsets.tobytes(), "lengths": self.lengths.tobytes(),
                "replica_crcs": crcs}

    @staticmethod
    def from_wire(wire: dict[str, Any]) -> "LocalPlan":
        ndim = wire["ndim"]
        tensor = np.frombuffer(wire["tensor"], dtype=np.int64)
        crcs = wire.get("replica_crcs")
        return LocalPlan(wire["tensors"], ndim, tensor,
                         np.frombuffer(wire["offsets"], dtype=np.int64).reshape(len(tensor), ndim),
                         np.frombuffer(wire["lengths"], dtype=np.int64).reshape(len(tensor), ndim),
                         np.frombuffer(crcs, dtype=np.uint32) if crcs is not None else None)
