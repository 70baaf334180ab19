"""Coordinators: how ranks exchange plans and agree on errors."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch.distributed as dist

from bcp.coord.base import Coordinator, SingleProcessCoordinator
from bcp.coord.forked_children import left_alone_in_forked_children
from bcp.coord.side_group import release_side_groups
from bcp.coord.torch_dist import TorchCoordinator

if TYPE_CHECKING:
    from bcp.coord.grpc import GrpcCoordinator

__all__ = ["Coordinator", "SingleProcessCoordinator", "TorchCoordinator", "default_coordinator",
           "coordinator_named", "as_coordinator", "release_connections", "COORDINATOR_ENV"]

COORDINATOR_ENV = "BCP_COORDINATOR"
"""Names the coordinator ``default_coordinator()`` gives (``torch`` or ``grpc``), for launchers."""

# The gRPC coordinator of each default process group (by id; None: met through MASTER_ADDR), made
# on first use and kept, so that its channels serve every save and load of the job, until that
# group is destroyed (release_connections).
_grpc: dict[int | None, "GrpcCoordinator"] = {}


def default_coordinator() -> Coordinator:
    """The coordinator named by ``BCP_COORDINATOR`` (read at each call); unset: the world's
    torch.distributed coordinator when a process group is initialized, else a single-process one."""
    name = os.environ.get(COORDINATOR_ENV)
    if name:
        return coordinator_named(name)
    if dist.is_available() and dist.is_initialized():
        return TorchCoordinator()
    return SingleProcessCoordinator()


def coordinator_named(name: str) -> Coordinator:
    """``"torch"``: the world's torch.distributed coordinator; ``"grpc"``: this job's gRPC coordinator
    (made collectively on first use, with its defaults, and reused after)."""
    if name == "torch":
        return TorchCoordinator()
    if name == "grpc":
        world = id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else None
        coordinator = _grpc.get(world)
        if coordinator is None or coordinator.closed:
            from bcp.coord.grpc import GrpcCoordinator  # grpc is imported only by jobs that use it

            coordinator = _grpc[world] = GrpcCoordinator()
        return coordinator
    raise ValueError(f"unknown coordinator {name!r} (from the argument or {COORDINATOR_ENV}); "
                     "known: 'torch', 'grpc'")


def as_coordinator(coordinator: "Coordinator | str | None") -> Coordinator:
    """What ``bcp.save``/``bcp.load`` use for their ``coordinator`` argument: a coordinator as given,
    a name for :func:`coordinator_named`, or None for :func:`default_coordinator`."""
    if coordinator is None:
        return default_coordinator()
    if isinstance(coordinator, str):
        return coordinator_named(coordinator)
    return coordinator


left_alone_in_forked_children(_grpc)


def release_connections(every: bool = False) -> None:
    """Shut down what coordination holds open for process groups that were destroyed: bcp's gloo
    side groups and the gRPC coordinators ``coordinator_named("grpc")`` made; ``every``: all of
    them, and every other open gRPC coordinator too (``bcp.shutdown()``, interpreter exit)."""
    release_side_groups(every)
    world = id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else None
    for key in [k for k in _grpc if every or (k is not None and k != world)]:
        _grpc.pop(key).close()
    grpc_module = sys.modules.get("bcp.coord.grpc.coordinator")  # never import grpc just to close nothing
    if every and grpc_module is not None:
        grpc_module.close_open_coordinators()
