"""gRPC coordinator nodes as threads of one process, meeting through one in-process store (a
``HashStore``; servers then listen on loopback): many nodes in one test, without a process per rank."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch.distributed as dist

from bcp.coord.grpc import GrpcCoordinator

JOIN_S = 120  # a guard against a hang in the code under test, not a timing assertion


def on_threads(count: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(i)`` for each i on a thread of its own: its value, or the exception it raised."""
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:  # handed to the test, which asserts on it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a coordinator node hung"
    return results


def start_nodes(world: int, namespace: str, **options: Any) -> list[GrpcCoordinator]:
    store = dist.HashStore()
    nodes = on_threads(world, lambda r: GrpcCoordinator(store=store, rank=r, world_size=world,
                                                        namespace=namespace, **options))
    for node in nodes:
        if isinstance(node, BaseException):
            raise node
    return nodes


def close_all(nodes: list[GrpcCoordinator]) -> None:
    for node in nodes:
        node.close()
