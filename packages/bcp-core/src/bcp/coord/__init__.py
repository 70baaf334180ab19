"""Coordinators: how ranks exchange plans and agree on errors."""

from __future__ import annotations

import torch.distributed as dist

from bcp.coord.base import Coordinator, SingleProcessCoordinator
from bcp.coord.torch_dist import TorchCoordinator

__all__ = ["Coordinator", "SingleProcessCoordinator", "TorchCoordinator", "default_coordinator"]


def default_coordinator() -> Coordinator:
    """The world's coordinator when a process group is initialized, else a single-process one."""
    if dist.is_available() and dist.is_initialized():
        return TorchCoordinator()
    return SingleProcessCoordinator()
