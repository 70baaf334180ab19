"""The coordinator over ``torch.distributed``, on a CPU-side gloo group of bcp's own with a bounded
timeout (even when training uses NCCL), so planning never touches the GPU and a dead rank fails
fast. Its life, who takes part in creating it and how its failures are reported: ``side_group``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bcp.coord.side_group import SideGroup, side_group
from bcp.coord.waiting import timeout_from_env, warn_after_from_env
from bcp.torch_internals.distributed import group_timeout

DEFAULT_TIMEOUT_S = 600.0
# Size of the block every exchange starts with (per rank, so it stays small for thousands of ranks).
BLOCK_BYTES = 256
_HEADER_BYTES = 16
INLINE_BYTES = BLOCK_BYTES - _HEADER_BYTES


class TorchCoordinator:
    """Exchanges bytes over a gloo group of bcp's own with the members of ``group`` (default: the
    world). Only those members construct it, together; ranks outside ``group`` take no part.

    ``timeout`` (seconds) bounds every wait for the other ranks, the group's setup included; by
    default ``BCP_TIMEOUT_S``, else the parent group's own timeout. ``warn_after`` (seconds; default
    ``BCP_WARN_AFTER_S`` or 30): a rank still waiting for the others (to set the group up, or in an
    exchange) after that long logs a WARNING naming the ranks that have not arrived (``None`` or 0: never).
    """

    def __init__(self, group: "dist.ProcessGroup | None" = None, timeout: float | None = None,
                 channel: str = "plan", warn_after: float | None = None) -> None:
        parent = group if group is not None else dist.group.WORLD
        self.parent = parent
        self.channel = channel
        self.warn_after = warn_after_from_env() if warn_after is None else (warn_after or None)
        self.timeout = timeout if timeout is not None else timeout_from_env(_group_timeout(parent))
        self.group: SideGroup = side_group(parent, self.timeout, channel, self.warn_after)
        self.rank = self.group.rank
        self.world_size = self.group.size

    def sibling(self) -> "TorchCoordinator":
        return TorchCoordinator(self.parent, self.timeout, channel=f"{self.channel}/background",
                                warn_after=self.warn_after or 0)

    def cache_key(self) -> object:
        # The ranks, not the group object: a plan stays valid for a re-created group of the same ranks.
        return ("torch.distributed", self.group.members, self.group.members[self.rank])

    def process_group(self) -> SideGroup:
        return self.group

    # Every exchange first sends one fixed-size block per rank: a header and, when the message fits,
    # the message itself. Small messages (agreements, acknowledgements, errors) so take one
    # collective; a larger one is sent in a second collective, padded to the largest message.

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        blocks = self._all_gather_blocks(data)
        sizes = [_size_of(b) for b in blocks]
        if max(sizes) <= INLINE_BYTES:
            return [_payload(b, n) for b, n in zip(blocks, sizes)]
        out = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.world_size)]
        self._run(lambda b: b.allgather([out], [_to_tensor(data, max(sizes))]))
        return [bytes(t[:n].numpy()) for t, n in zip(out, sizes)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        blocks = self._all_gather_blocks(data)
        sizes = [_size_of(b) for b in blocks]
        if max(sizes) <= INLINE_BYTES:
            return [_payload(b, n) for b, n in zip(blocks, sizes)] if self.rank == 0 else None
        # gloo's gather needs every rank's tensor the same size: the sizes just gathered give it.
        padded = _to_tensor(data, max(sizes))
        if self.rank == 0:
            out = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.world_size)]
            self._run(lambda b: b.gather([out], [padded]))
            return [bytes(t[:n].numpy()) for t, n in zip(out, sizes)]
        self._run(lambda b: b.gather([], [padded]))
        return None

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        blocks = None
        if self.rank == 0:
            assert parts is not None and len(parts) == self.world_size
            width = max(len(p) for p in parts)
            blocks = [_block(p, width) for p in parts]
        out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        self._run(lambda b: b.scatter([out], [blocks] if blocks is not None else []))
        size, width = _size_of(out), _width_of(out)
        if width <= INLINE_BYTES:
            return _payload(out, size)
        big = torch.empty(width, dtype=torch.uint8)
        chunks = [_to_tensor(p, width) for p in parts] if self.rank == 0 else None
        self._run(lambda b: b.scatter([big], [chunks] if chunks is not None else []))
        return bytes(big[:size].numpy())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        block = _block(data, len(data)) if self.rank == 0 else torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        self._run(lambda b: b.broadcast([block]))
        size = _size_of(block)
        if size <= INLINE_BYTES:
            return _payload(block, size)
        buf = _to_tensor(data, size) if self.rank == 0 else torch.empty(size, dtype=torch.uint8)
        self._run(lambda b: b.broadcast([buf]))
        return bytes(buf.numpy())

    def _all_gather_blocks(self, data: bytes) -> list[torch.Tensor]:
        blocks = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in range(self.world_size)]
        self._run(lambda b: b.allgather([blocks], [_block(data, len(data))]))
        return blocks

    def _run(self, op) -> None:
        """Runs ``op(backend)`` on the side group; the root of every rooted collective is member 0,
        the default of gloo's options. After a failure (which released the group, see
        ``side_group``) the next exchange, that of a later save, rebuilds it."""
        if self.group.backend is None and not self.group.closed:
            self.group = side_group(self.parent, self.timeout, self.channel, self.warn_after)
        self.group.run(op, self.warn_after)


def _block(data: bytes, width: int) -> torch.Tensor:
    """A fixed-size block: the message's size, the widest message of the exchange (both int64),
    then the message itself if that widest one fits."""
    block = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    block[:_HEADER_BYTES].view(torch.int64)[:] = torch.tensor([len(data), width], dtype=torch.int64)
    if width <= INLINE_BYTES and data:
        block[_HEADER_BYTES:_HEADER_BYTES + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return block


def _size_of(block: torch.Tensor) -> int:
    return int(block[:_HEADER_BYTES].view(torch.int64)[0])


def _width_of(block: torch.Tensor) -> int:
    return int(block[:_HEADER_BYTES].view(torch.int64)[1])


def _payload(block: torch.Tensor, size: int) -> bytes:
    return bytes(block[_HEADER_BYTES:_HEADER_BYTES + size].numpy())


def _to_tensor(data: bytes, width: int) -> torch.Tensor:
    t = torch.zeros(width, dtype=torch.uint8)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _group_timeout(group: "dist.ProcessGroup") -> float:
    timeout = group_timeout(group)
    return DEFAULT_TIMEOUT_S if timeout is None else timeout
