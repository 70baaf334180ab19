"""The coordinator over ``torch.distributed``, on a CPU-side gloo group with a bounded timeout
(even when training uses NCCL), so planning never touches the GPU and a dead rank fails fast."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from bcp.errors import DistributedError

DEFAULT_TIMEOUT_S = 600.0
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

    def _sizes(self, data: bytes) -> list[int]:
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._run(dist.all_gather, sizes, size, group=self.group)
        return [int(s.item()) for s in sizes]

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        sizes = self._sizes(data)
        padded = _to_tensor(data, max(sizes))
        out = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.world_size)]
        self._run(dist.all_gather, out, padded, group=self.group)
        return [bytes(t[:n].numpy()) for t, n in zip(out, sizes)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        # all_gather of the sizes keeps every rank's padded length equal; gloo's gather needs that.
        sizes = self._sizes(data)
        padded = _to_tensor(data, max(sizes))
        if self.rank == 0:
            out = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.world_size)]
            self._run(dist.gather, padded, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
            return [bytes(t[:n].numpy()) for t, n in zip(out, sizes)]
        self._run(dist.gather, padded, None, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return None

    def scatter_bytes(self, parts: list[bytes] | None) -> bytes:
        src = dist.get_global_rank(self.group, 0)
        header = torch.zeros(self.world_size, dtype=torch.int64)
        if self.rank == 0:
            assert parts is not None and len(parts) == self.world_size
            header = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        self._run(dist.broadcast, header, src=src, group=self.group)
        width = int(header.max().item()) if self.world_size else 0
        out = torch.empty(width, dtype=torch.uint8)
        chunks = [_to_tensor(p, width) for p in parts] if self.rank == 0 else None
        self._run(dist.scatter, out, chunks, src=src, group=self.group)
        return bytes(out[: int(header[self.rank].item())].numpy())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        src = dist.get_global_rank(self.group, 0)
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self._run(dist.broadcast, size, src=src, group=self.group)
        buf = _to_tensor(data, int(size.item())) if self.rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8)
        self._run(dist.broadcast, buf, src=src, group=self.group)
        return bytes(buf.numpy())

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
