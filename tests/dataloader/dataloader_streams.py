"""The token stream loader the dataloader tests train with, and the uninterrupted runs they compare
against (one process, every DP rank's loader side by side)."""

from __future__ import annotations

import bcp

STREAMS = 4
SEQ_LEN = 7


def sources() -> dict[str, list[list[int]]]:
    """Three sources of documents of varied length; every token id is unique (source, document,
    position), so a multiset of tokens shows any token lost or delivered twice."""
    return {name: [[base + 1000 * doc + pos for pos in range(1 + (doc * 7 + base // 100_000) % 11)]
                   for doc in range(count)]
            for name, base, count in [("web", 100_000, 60), ("code", 200_000, 40), ("books", 300_000, 24)]}


RATIOS = {"web": 5.0, "code": 3.0, "books": 1.0}


def loader(dp_rank: int, dp_size: int) -> bcp.TokenStreamLoader:
    return bcp.TokenStreamLoader(sources(), RATIOS, seq_len=SEQ_LEN, streams=STREAMS, dp_rank=dp_rank,
                                 dp_size=dp_size, seed=7)


def uninterrupted(dp_size: int, steps: int) -> list[list[list[list[int]]]]:
    """Per DP rank, per step, the rank's batch of an uninterrupted run."""
    loaders = [loader(r, dp_size) for r in range(dp_size)]
    return [[one.next_batch() for _ in range(steps)] for one in loaders]
