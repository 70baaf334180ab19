"""A large matrix saved by rows across the ranks as a DTensor and loaded back on another number of
ranks, on S3 (rank functions for the ``ranks`` pools of the S3 tests)."""

from __future__ import annotations

import os

import bcp
import torch

COLS = 2048


def _big_matrix(rows: int) -> torch.Tensor:
    return torch.randn(rows, COLS, generator=torch.Generator().manual_seed(7))


def _sharded(full: torch.Tensor) -> torch.nn.Module:
    """A module whose one parameter is ``full`` sharded by rows across the ranks (a DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]), requires_grad=False)
    return module


def save_big_sharded(url: str, env: dict[str, str], rows: int) -> None:
    os.environ.update(env)  # the rank processes were started before the server: point them at it
    bcp.save(url, {"model": _sharded(_big_matrix(rows))})


def load_big_sharded(url: str, env: dict[str, str], rows: int) -> bool:
    """Whether this rank's shard loaded bitwise equal to the saved matrix's rows."""
    os.environ.update(env)
    target = _sharded(torch.zeros(rows, COLS))
    bcp.load(url, {"model": target})
    expected = _sharded(_big_matrix(rows)).w.to_local()
    return torch.equal(target.w.to_local().view(torch.int32), expected.view(torch.int32))
