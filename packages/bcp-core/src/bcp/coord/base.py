"""The coordinator: collective exchange of small plain-data messages between ranks.

Planning (gather local plans, scatter global plans, agree on errors) goes through this interface
only, so a transport other than ``torch.distributed`` (a gRPC tree, paper section 5.2) plugs in by
implementing four methods on bytes. Messages are msgpack (``consensus``): plain data, never pickle.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather_bytes(self, data: bytes) -> list[bytes]: ...

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Rank 0 receives every rank's bytes; the others receive None."""

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        """Rank 0 passes one message per rank; every rank receives its own."""

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes, on every rank."""

    def sibling(self) -> "Coordinator":
        """A coordinator over the same ranks on a channel of its own, for exchanges made from a
        background thread while this one keeps planning. Every rank must call it (collectively)."""

    def cache_key(self) -> object:
        """Identifies the channel: plans cached under it stay valid while the ranks stay the same."""

    def process_group(self) -> Any:
        """A group over the same ranks, in the same order, that moves tensors between them
        (``isend(tensor, member, tag)``/``irecv``, for ``load(read_once=True)``); None where the
        transport has none."""


class SingleProcessCoordinator:
    """The coordinator of a run without a process group: every exchange is with oneself."""

    rank = 0
    world_size = 1

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        return [data]

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        assert parts is not None and len(parts) == 1
        return parts[0]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def sibling(self) -> "SingleProcessCoordinator":
        return self

    def cache_key(self) -> object:
        return "single-process"

    def process_group(self) -> None:
        return None
