"""How a coordinator's ranks find each other: through a torch.distributed store (the one given, the
default process group's, or a TCPStore at ``MASTER_ADDR:MASTER_PORT`` when no group exists). Rank 0
puts the job's secret there; every rank puts its record (machine name, listening address); each rank
reads only its parent's and children's records, so the store serves O(world) small reads in all."""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import msgpack
import torch.distributed as dist

from bcp.coord.grpc.security import new_secret
from bcp.coord.waiting import store_keys_set, store_wait, wait_for
from bcp.errors import DistributedError
from bcp.torch_internals.distributed import default_store

log = logging.getLogger("bcp.coord")

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Peer:
    """Where a rank runs: its machine's name and the address its server listens on ("" if none)."""

    machine: str
    address: str

    def describe(self) -> str:
        return f"{self.machine} ({self.address})" if self.address else self.machine


@dataclass
class Meeting:
    """A store and this process's place in the job, as found by :func:`meet`."""

    store: Any
    rank: int
    world_size: int
    bind_host: str

    def scoped(self, namespace: str) -> Any:
        return dist.PrefixStore(f"bcp/grpc/{namespace}", self.store)


def meet(store: Any, rank: int | None, world_size: int | None, host: str | None, timeout: float) -> Meeting:
    """The store to meet through, this rank, the world size and the interface to listen on."""
    if store is None and dist.is_available() and dist.is_initialized():
        store = default_store()  # the store the process group met through
    if rank is None or world_size is None:
        rank, world_size = _place(rank, world_size)
    if store is None:
        store = _store_from_environment(rank, world_size, timeout)
    return Meeting(store, rank, world_size, host or _interface_towards(store))


def share_secret(store: Any, rank: int, timeout: float, warn_after: float | None = None) -> str:
    """Rank 0's fresh secret, on every rank."""
    if rank == 0:
        store.set("secret", new_secret())
    return _get(store, "secret", timeout, rank, 0, "secret", warn_after).decode()


def publish(store: Any, rank: int, peer: Peer) -> None:
    store.set(f"peer/{rank}", msgpack.packb([peer.machine, peer.address]))


def look_up(store: Any, rank: int, ranks: list[int], timeout: float,
            warn_after: float | None = None) -> dict[int, Peer]:
    """The records of ``ranks`` (this rank's parent and children), as each of them publishes it."""
    return {r: Peer(*msgpack.unpackb(_get(store, f"peer/{r}", timeout, rank, r, "address", warn_after)))
            for r in ranks}


def _get(store: Any, key: str, timeout: float, rank: int, owner: int, what: str, warn_after: float | None) -> bytes:
    """``owner``'s ``what`` (its ``key``), once it is set: waited for up to ``timeout`` seconds, with
    a WARNING naming ``owner`` after ``warn_after`` seconds."""
    def warn(waited: float) -> None:
        log.warning("rank %d has waited %gs to set up the gRPC checkpoint coordinator for rank %d's %s: rank %d "
                    "has not called bcp. Every rank must call bcp.save / bcp.load together (a save or load called "
                    "on some ranks only, as under `if rank == 0:`, waits until the timeout of %gs and then fails)",
                    rank, waited, owner, what, owner, timeout)

    try:
        if wait_for(store_keys_set(store, [key]), timeout, warn_after, warn, store_wait(store, [key])):
            return store.get(key)
        why = f"did not appear in the store within {timeout:g}s"
    except Exception as exc:  # torch raises DistNetworkError/RuntimeError on lost stores
        why = f"could not be read from the store: {exc}"
    raise DistributedError(f"rank {owner}'s {what} {why} (rank {owner} died, hung or did not call bcp: every rank must "
                           f"call bcp.save / bcp.load together; or the store's host is gone)")


def _place(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank,
                dist.get_world_size() if world_size is None else world_size)
    try:
        return (int(os.environ["RANK"]) if rank is None else rank,
                int(os.environ["WORLD_SIZE"]) if world_size is None else world_size)
    except KeyError as exc:
        raise DistributedError(f"the gRPC coordinator needs rank and world_size, a process group, "
                               f"or the {exc.args[0]} environment variable") from None


def _store_from_environment(rank: int, world_size: int, timeout: float) -> Any:
    """A TCPStore at MASTER_ADDR:MASTER_PORT, hosted by rank 0 unless a launcher's agent hosts it."""
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        raise DistributedError(f"the gRPC coordinator found no process group, no store was given, and "
                               f"{exc.args[0]} is not set") from None
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return dist.TCPStore(addr, port, world_size, is_master=hosts, timeout=datetime.timedelta(seconds=timeout))


def _interface_towards(store: Any) -> str:
    """The local address on the route to the store's TCP server (a connected UDP socket sends
    nothing; the kernel only picks the route); loopback for stores without a server (FileStore)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return LOOPBACK
    family = socket.AF_INET6 if ":" in store.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((store.host, store.port))
        return probe.getsockname()[0]
