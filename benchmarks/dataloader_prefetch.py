"""The training stall of collecting dataloader state at a checkpoint step, with and without
prefetching (paper section 4.5), for ``bcp.TokenStreamLoader`` with ~100 MB of token buffers.

One process trains (a few CPU matrix products per step) on batches from a loader whose read-worker
threads hold ``--buffer-mb`` of buffered tokens between them. At every ``--every``-th step the
checkpoint's dataloader values are collected (``DataloaderState.saved_values()``, what ``bcp.save``
calls first); the time that takes is the stall. Without prefetching it is a round trip to every
worker (each turns its buffer into a tensor while training waits); with it, the workers built that
state during the previous step and the collection only picks it up. After the last checkpoint
step, one whole ``bcp.save`` of the state is timed each way (collect, plan, write ~100 MB, commit).

    .venv/bin/python benchmarks/dataloader_prefetch.py [--buffer-mb 100] [--every 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import bcp

STREAMS, SEQ_LEN = 4, 4096


def _loader(buffer_tokens: int) -> bcp.TokenStreamLoader:
    sources = {"web": [list(range(d * 5000, d * 5000 + 3000)) for d in range(64)],
               "code": [list(range(10**9 + d * 5000, 10**9 + d * 5000 + 1500)) for d in range(64)]}
    loader = bcp.TokenStreamLoader(sources, {"web": 3.0, "code": 1.0}, seq_len=SEQ_LEN, streams=STREAMS,
                                   dp_rank=0, dp_size=1)
    for reader in loader.readers:  # a long document backlog, as a packing loader accumulates
        reader.buffer = list(range(buffer_tokens // STREAMS))
    return loader


def _train_step(weights: torch.Tensor) -> None:
    for _ in range(8):
        weights = torch.tanh(weights @ weights)


def run(prefetch: bool, args: argparse.Namespace) -> tuple[list[float], float]:
    """Stalls (ms) at the checkpoint steps, then one bcp.save's blocking time (ms)."""
    loader = _loader(int(args.buffer_mb * 2**20) // 8)
    dataloader = bcp.DataloaderState(loader, dp_rank=0, dp_size=1,
                                     checkpoint_every=args.every if prefetch else None)
    weights = torch.randn(512, 512) / 32
    stalls = []
    for step in range(1, args.steps + 1):
        loader.next_batch()
        _train_step(weights)
        if step % args.every == 0:
            start = time.perf_counter()
            dataloader.saved_values()
            stalls.append((time.perf_counter() - start) * 1e3)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        bcp.save(folder, {"dataloader": dataloader})
        saved = (time.perf_counter() - start) * 1e3
    expected_trips = 0 if prefetch else len(stalls) + 1  # the save after the last checkpoint step too
    assert loader.state_round_trips == expected_trips, (loader.state_round_trips, expected_trips)
    loader.close()
    return stalls, saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffer-mb", type=float, default=100)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(f"{args.buffer_mb:g} MB of token buffers over {STREAMS} read workers, a checkpoint every "
          f"{args.every} steps, {args.steps // args.every} checkpoints\n")
    print("| collecting the state | stall median (ms) | min | max | whole bcp.save (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for prefetch in (False, True):
        stalls, saved = run(prefetch, args)
        print(f"| {'prefetched one step ahead' if prefetch else 'round trip to the workers'} | "
              f"{statistics.median(stalls):.2f} | {min(stalls):.2f} | {max(stalls):.2f} | {saved:.0f} |")


if __name__ == "__main__":
    main()
