"""TorchCoordinator's byte exchanges: messages that fit the first fixed-size block and larger ones
(sent in a second round), mixed across ranks, arrive intact for every operation."""

from __future__ import annotations

import bcp
from bcp.coord.torch_dist import INLINE_BYTES

# Empty, the largest inline message, one byte over, and a large one.
SIZES = [0, INLINE_BYTES, INLINE_BYTES + 1, 100_000]


def message(size: int, sender: int, receiver: int = 0) -> bytes:
    return bytes((sender * 31 + receiver * 7 + i) % 256 for i in range(size))


def exchanges_case() -> list[str]:
    coord = bcp.TorchCoordinator()
    me, world = coord.rank, coord.world_size
    failures = []
    for small in SIZES:
        for large in SIZES:
            mine = small if me == 0 else large  # rank 0's size differs from the others'
            sizes = [small] + [large] * (world - 1)
            if coord.all_gather_bytes(message(mine, me)) != [message(n, r) for r, n in enumerate(sizes)]:
                failures.append(f"all_gather {small}/{large}")
            gathered = coord.gather_bytes(message(mine, me))
            if gathered != ([message(n, r) for r, n in enumerate(sizes)] if me == 0 else None):
                failures.append(f"gather {small}/{large}")
            parts = [message(n, 0, r) for r, n in enumerate(sizes)] if me == 0 else None
            if coord.scatter_bytes(parts) != message(sizes[me], 0, me):
                failures.append(f"scatter {small}/{large}")
        if coord.broadcast_bytes(message(small, 0) if me == 0 else None) != message(small, 0):
            failures.append(f"broadcast {small}")
    return failures


def test_exchanges_deliver_small_and_large_messages(ranks):
    for failures in ranks(3).run(exchanges_case):
        assert failures == []
