"""Every operation of the gRPC coordinator delivers exact bytes through a tree (empty, small and
large messages, mixed across ranks); ranks calling different operations fail with a report; a
coordinator of one rank exchanges with itself."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from grpc_nodes import close_all, on_threads, start_nodes

import bcp
from bcp.coord.grpc import GrpcCoordinator

SIZES = [0, 1, 100_000, 2_000_000]


def message(size: int, sender: int, receiver: int = 0) -> bytes:
    return (f"{sender}>{receiver};".encode() * (size // 4 + 1))[:size]


@pytest.fixture(scope="module")
def nine_nodes():
    nodes = start_nodes(9, "contents", timeout=60, ranks_per_machine=2, fan_out=2)
    yield nodes
    close_all(nodes)


@pytest.mark.parametrize("root_size", SIZES)
def test_every_operation_delivers_exact_bytes_through_the_tree(nine_nodes, root_size):
    world = len(nine_nodes)
    sizes = [root_size] + [SIZES[r % len(SIZES)] for r in range(1, world)]

    def exchanges(rank: int) -> list[bool]:
        node = nine_nodes[rank]
        everyone = [message(n, r) for r, n in enumerate(sizes)]
        gathered = node.gather_bytes(message(sizes[rank], rank))
        scattered = node.scatter_bytes([message(n, 0, r) for r, n in enumerate(sizes)] if rank == 0 else None)
        broadcast = node.broadcast_bytes(message(root_size, 0) if rank == 0 else None)
        return [node.all_gather_bytes(message(sizes[rank], rank)) == everyone,
                gathered == (everyone if rank == 0 else None),
                scattered == message(sizes[rank], 0, rank),
                broadcast == message(root_size, 0)]

    assert on_threads(world, exchanges) == [[True] * 4] * world


def test_ranks_calling_different_operations_all_fail_naming_the_odd_one():
    nodes = start_nodes(3, "mismatch", timeout=20, ranks_per_machine=3)
    try:
        results = on_threads(3, lambda r: nodes[r].gather_bytes(b"x") if r == 2 else nodes[r].all_gather_bytes(b"x"))
        again = nodes[0].all_gather_bytes  # a coordinator whose ranks are out of step takes no more exchanges
        with pytest.raises(bcp.DistributedError, match="earlier exchange failed"):
            again(b"y")
    finally:
        close_all(nodes)
    for result in results:
        assert isinstance(result, bcp.DistributedError)
        assert "rank 2 on" in str(result) and "called gather while rank 0 called all_gather" in str(result)


def test_a_coordinator_of_one_rank_exchanges_with_itself():
    with GrpcCoordinator(store=dist.HashStore(), rank=0, world_size=1, timeout=5, namespace="alone") as node:
        assert node.address == ""  # no children: no server
        assert node.all_gather_bytes(b"a") == [b"a"] and node.gather_bytes(b"b") == [b"b"]
        assert node.scatter_bytes([b"c"]) == b"c" and node.broadcast_bytes(b"d") == b"d"
