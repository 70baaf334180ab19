"""The coordinator over ``torch.distributed``, on a CPU-side gloo group with a bounded timeout
(even when training uses NCCL), so planning never touches the GPU and a dead rank fails fast."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from bcp.errors import DistributedError

DEFAULT_TIMEOUT_S = 600.0
# Size of the block every exchange starts with (per rank, so it stays small for thousands of ranks).
BLOCK_BYTES = 256
_HEADER_BYTES = 16
INLINE_BYTES = BLOCK_BYTES - _HEADER_BYTES
# (id of parent group, timeout, channel) -> gloo group; entries whose group was destroyed are rebuilt.
_groups: dict[tuple[int, float, str], "dist.ProcessGroup"] = {}


class TorchCoordinator:
    """Exchanges bytes over a gloo group derived from ``group`` (default: the world).

    ``timeout`` (seconds) bounds every exchange; by default it is the parent group's own timeout.
    """

    def __init__(self, group: "dist.ProcessGroup | None" = None, timeout: float | None = None,
                 channel: str = "plan") -> None:
        parent = group if group is not None else dist.group.WORLD
        self.parent = parent
        self.channel = channel
        self.timeout = timeout if timeout is not None else _group_timeout(parent)
        self.group = _gloo_group(parent, self.timeout, channel)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def sibling(self) -> "TorchCoordinator":
        return TorchCoordinator(self.parent, self.timeout, channel=f"{self.channel}/background")

    def cache_key(self) -> object:
        return (id(self.group), self.rank, self.world_size)

    def process_group(self) -> "dist.ProcessGroup":
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
        self._run(dist.all_gather, out, _to_tensor(data, max(sizes)), group=self.group)
        return [bytes(t[:n].numpy()) for t, n in zip(out, sizes)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        blocks = self._all_gather_blocks(data)
        sizes = [_size_of(b) for b in blocks]
        if max(sizes) <= INLINE_BYTES:
            return [_payload(b, n) for b, n in zip(blocks, sizes)] if self.rank == 0 else None
        # gloo's gather needs every rank's tensor the same size: the sizes just gathered give it.
        padded = _to_tensor(data, max(sizes))
        dst = dist.get_global_rank(self.group, 0)
        if self.rank == 0:
            out = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.world_size)]
            self._run(dist.gather, padded, out, dst=dst, group=self.group)
            return [bytes(t[:n].numpy()) for t, n in zip(out, sizes)]
        self._run(dist.gather, padded, None, dst=dst, group=self.group)
        return None

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        src = dist.get_global_rank(self.group, 0)
        blocks = None
        if self.rank == 0:
            assert parts is not None and len(parts) == self.world_size
            width = max(len(p) for p in parts)
            blocks = [_block(p, width) for p in parts]
        out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        self._run(dist.scatter, out, blocks, src=src, group=self.group)
        size, width = _size_of(out), _width_of(out)
        if width <= INLINE_BYTES:
            return _payload(out, size)
        big = torch.empty(width, dtype=torch.uint8)
        chunks = [_to_tensor(p, width) for p in parts] if self.rank == 0 else None
        self._run(dist.scatter, big, chunks, src=src, group=self.group)
        return bytes(big[:size].numpy())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        src = dist.get_global_rank(self.group, 0)
        block = _block(data, len(data)) if self.rank == 0 else torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        self._run(dist.broadcast, block, src=src, group=self.group)
        size = _size_of(block)
        if size <= INLINE_BYTES:
            return _payload(block, size)
        buf = _to_tensor(data, size) if self.rank == 0 else torch.empty(size, dtype=torch.uint8)
        self._run(dist.broadcast, buf, src=src, group=self.group)
        return bytes(buf.numpy())

    def _all_gather_blocks(self, data: bytes) -> list[torch.Tensor]:
        blocks = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in range(self.world_size)]
        self._run(dist.all_gather, blocks, _block(data, len(data)), group=self.group)
        return blocks

    def _run(self, op, *args, **kwargs) -> None:
        try:
            op(*args, **kwargs)
        except BaseException as exc:  # torch raises DistBackendError/RuntimeError on timeouts and dead peers
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise DistributedError(
                f"checkpoint coordination failed after at most {self.timeout:.0f}s "
                f"(a rank died, hung or did not call bcp): {exc}"
            ) from exc


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
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # private attribute: fall back to a bounded default if torch moves it
        try:
            return group._get_backend(torch.device("cuda")).options._timeout.total_seconds()
        except Exception:
            return DEFAULT_TIMEOUT_S


def _gloo_group(parent: "dist.ProcessGroup", timeout: float, channel: str) -> "dist.ProcessGroup":
    """One gloo group per (parent group, timeout, channel), created collectively on first use."""
    key = (id(parent), timeout, channel)
    group = _groups.get(key)
    live = dist.distributed_c10d._world.pg_map
    if group is None or group not in live or parent not in live:
        ranks = None if parent is dist.group.WORLD else dist.get_process_group_ranks(parent)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        _groups[key] = group
    return group
