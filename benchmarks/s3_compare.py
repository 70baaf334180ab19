"""bcp on S3 next to DCP over fsspec (s3fs) and the client's own raw transfer, on one local SeaweedFS.

    .venv/bin/python benchmarks/s3_compare.py                 # ~1 GB of GPT-like fp32 state, 3 reps
    .venv/bin/python benchmarks/s3_compare.py --size-mb 128 --reps 2
    .venv/bin/python benchmarks/s3_compare.py --worlds 2 --max-requests 4 8 16   # the cap, side by side
    .venv/bin/python benchmarks/s3_compare.py --worlds 2 --reps 9 --cases "bcp load resharded" \
        "raw load, every process's bytes, half kept"    # one load and its floor (and the saves they read)

For 1 and 2 processes (gloo, the state cut on dim 0 as DTensors when 2): the raw floor, with the client
bcp uses (obstore) at bcp's request size (16 MiB) and cap on requests in flight (the first
``--max-requests`` value, default 8): a parallel multipart upload of each process's bytes as one
object, and 16 MiB ranged GETs back, each its own request, each range copied into preallocated
memory; with 2 processes also each process fetching every process's bytes and keeping half of each
range (the floor of a load resharded to dim 1, which needs half of every saved row, spans of a few
KiB that no reader fetches one by one), and the same keeping nothing. Then bcp save/load at its
defaults (same layout; with 2 processes also a load resharded to dim 1), once per ``--max-requests``
value (rows without a cap in their name ran with the first value) and DCP through
``FsspecWriter``/``FsspecReader`` (s3fs; default, and the writer with ``thread_count`` = bcp's I/O
threads). The server is ``tests/s3_test_server.py``'s, started here and killed at the end. The cases
run in rounds (each case once per round) so that a shared machine's drifting load weighs on all
alike. Prints a markdown table of medians (seconds) and ratios, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the test suite's SeaweedFS launcher

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bcpbench.launch import launch  # noqa: E402
from bcpbench.state import gpt_shapes, local_piece, local_shape, random_tensor, shard_dim, shapes_nbytes  # noqa: E402

SEED = 5
PART = 16 << 20


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _timed(work: Callable[[], Any], reps: int, before: Callable[[], Any] = lambda: None) -> list[float]:
    """Wall seconds of ``work`` on the whole job (from a barrier to a barrier), ``reps`` times."""
    times = []
    for _ in range(reps):
        before()
        _barrier()
        start = time.perf_counter()
        work()
        _barrier()
        times.append(time.perf_counter() - start)
    return times


def cases(config: dict) -> dict:
    """Every case on this process's share of the state; rank 0's timings come back."""
    os.environ.update(config["env"])
    torch.set_num_threads(1)
    import obstore
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import bcp
    from bcp.api.options import DEFAULT_IO_THREADS
    from bcp.storage import S3Storage
    from bcp.storage.s3_connection import MAX_REQUESTS

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    shapes = gpt_shapes(config["size_bytes"])
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))

    def layout(dim: int, fill: Callable[[str], torch.Tensor]) -> dict[str, Any]:
        if mesh is None:
            return {n: fill(n) for n in shapes}
        from torch.distributed.tensor import DTensor, Shard

        return {n: DTensor.from_local(fill(n), mesh, [Shard(shard_dim(s, dim))], run_check=False, shape=s,
                                      stride=torch.empty(s, device="meta").stride()) for n, s in shapes.items()}

    def piece(name: str, dim: int) -> torch.Tensor:
        return local_piece(random_tensor(shapes, name, SEED), dim, rank, world).clone()

    state = layout(0, lambda n: piece(n, 0))
    locals_ = [t.to_local() if mesh is not None else t for t in state.values()]
    nbytes = sum(t.numel() * 4 for t in locals_)
    base = f"s3://{config['bucket']}/bench-{config['run']}-w{world}"
    env = config["env"]
    bucket_store = obstore.store.S3Store(config["bucket"], config={
        "endpoint": env["AWS_ENDPOINT_URL"], "region": env["AWS_REGION"], "access_key_id": env["AWS_ACCESS_KEY_ID"],
        "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}, client_options={"allow_http": True})
    fresh: list[str] = []
    done: list[str] = []

    def new_prefix() -> str:  # the same on every rank: the n-th checkpoint of the run
        fresh.append(f"c{len(fresh) + len(done)}")
        return fresh[-1]

    def clean() -> None:  # keep the server's disk small: only the newest of each kind stays
        for prefix in fresh[:-1]:
            if rank == 0:
                S3Storage(f"{base}/{prefix}").delete_tree("")
        done.extend(fresh[:-1])
        del fresh[:-1]

    results: dict[str, list[float]] = {}
    reps = config["reps"]
    threads = config["io_threads"] or DEFAULT_IO_THREADS
    caps = config["max_requests"] or [MAX_REQUESTS]

    # Each case: (name, work, before, after); every round runs them all once, in this order, so that the
    # load of a shared machine drifting during the run weighs on every case alike.
    case_list: list[tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = []
    nothing: Callable[[], Any] = lambda: None  # noqa: E731
    next_checkpoint = lambda: (clean(), new_prefix())  # noqa: E731

    # Raw floor: this process's bytes as one object, uploaded in parallel parts and read back by ranges
    # with the client bcp uses, at bcp's request size and cap, into memory (as every load must).
    views = [memoryview(t.numpy()).cast("B") for t in locals_]
    raw_key = lambda owner=rank: f"bench-{config['run']}-w{world}/{fresh[-1]}/raw-{owner}"  # noqa: E731
    case_list.append(("raw save", lambda: obstore.put(bucket_store, raw_key(), iter(views), chunk_size=PART,
                                                      max_concurrency=caps[0]), next_checkpoint, nothing))
    landing = np.zeros(nbytes, dtype=np.uint8)  # touched now: no page faults timed
    sizes = [nbytes] * world
    if world > 1:
        dist.all_gather_object(sizes, nbytes)

    def raw_load(owners: list[int], keep: float) -> None:
        """16 MiB ranged GETs of the owners' objects, each its own request, ``caps[0]`` in flight; the
        first ``keep`` of each range copied into ``landing`` (numpy's copy, outside the GIL)."""
        ranges = [(owner, start) for owner in owners for start in range(0, sizes[owner], PART)]
        kept = [0]
        for owner, start in ranges:
            kept.append(kept[-1] + int(min(PART, sizes[owner] - start) * keep))

        def one(index: int) -> None:
            owner, start = ranges[index]
            piece = obstore.get_range(bucket_store, raw_key(owner), start=start, end=min(start + PART, sizes[owner]))
            at, end = kept[index], kept[index + 1]
            np.copyto(landing[at:end], np.frombuffer(piece, dtype=np.uint8)[:end - at])

        with ThreadPoolExecutor(caps[0]) as pool:
            list(pool.map(one, range(len(ranges))))

    case_list.append(("raw load", partial(raw_load, [rank], 1.0), nothing, nothing))
    if world > 1:
        # A load resharded from dim 0 to dim 1 needs half of every saved row: spans of a few KiB spread
        # over every process's object, which no reader fetches one by one. Its floor fetches every
        # process's bytes and keeps half of them.
        case_list.append(("raw load, every process's bytes, half kept", partial(raw_load, list(range(world)), 0.5),
                          nothing, nothing))
        case_list.append(("raw load, every process's bytes, none kept", partial(raw_load, list(range(world)), 0.0),
                          nothing, nothing))

    def zeros(dim: int) -> dict[str, Any]:
        return layout(dim, lambda n: torch.zeros(local_shape(shapes[n], dim, world)))

    def check(loaded: dict[str, Any], dim: int) -> None:
        for n, t in loaded.items():
            local = t.to_local() if mesh is not None else t
            assert torch.equal(local, piece(n, dim)), n

    def loads(name: str, load: Callable[[dict[str, Any]], Any], suffix: str = "") -> None:
        """The same-layout load and, with 2 processes, the load resharded to dim 1, each checked."""
        for dim in ([0] if world == 1 else [0, 1]):
            targets: dict[str, Any] = {}
            case_list.append((f"{name} load{' resharded' if dim else ''}{suffix}", partial(load, targets),
                              partial(lambda t, d: t.update(zeros(d)), targets, dim), partial(check, targets, dim)))

    for cap in caps:
        named = "" if cap == caps[0] else f", max_requests={cap}"
        case_list.append((f"bcp save{named}", partial(lambda c: bcp.save(
            S3Storage(f"{base}/{fresh[-1]}", max_requests=c), {"model": state},
            bcp.SaveOptions(io_threads=threads)), cap), next_checkpoint, nothing))
        loads("bcp", partial(lambda c, targets: bcp.load(
            S3Storage(f"{base}/{fresh[-1]}", max_requests=c), {"model": targets},
            bcp.LoadOptions(io_threads=threads)), cap), named)

    for name, writer in (("DCP save", {}), (f"DCP save, thread_count={threads}", {"thread_count": threads})):
        case_list.append((name, partial(lambda w: dcp.save(state, storage_writer=FsspecWriter(
            f"{base}/{fresh[-1]}", sync_files=False, **w)), writer), next_checkpoint, nothing))
    loads("DCP", lambda targets: dcp.load(targets, storage_reader=FsspecReader(f"{base}/{fresh[-1]}")))

    if config["cases"]:
        unknown = set(config["cases"]) - {name for name, *_ in case_list}
        if unknown:
            raise ValueError(f"no such case: {sorted(unknown)}; the cases are {[name for name, *_ in case_list]}")
        case_list = [case for case in case_list if _runs(case[0], config["cases"])]
    for _ in range(reps):
        for name, work, before, after in case_list:
            results.setdefault(name, []).extend(_timed(work, 1, before))
            after()
    fresh.append("")
    clean()
    return {"nbytes": nbytes * world, "times": results}


def _family(name: str) -> tuple[str, str]:
    """Who made a case's checkpoint (raw, bcp or DCP) and with which cap: a load reads the newest save
    of its family."""
    return name.split(" ")[0], name.partition(", max_requests=")[2]


def _runs(name: str, chosen: list[str]) -> bool:
    """Whether a case runs when only ``chosen`` were asked for: those, and every save of a family one
    of them loads from (each round's loads read that round's save)."""
    return name in chosen or (" save" in name and any(_family(c) == _family(name) for c in chosen))


def table(world: int, result: dict) -> str:
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    gb = result["nbytes"] / 1e9
    rows = [f"### {world} process{'es' if world > 1 else ''}, {result['nbytes'] / 1e6:.0f} MB", "",
            "| case | median s | GB/s | vs raw floor | bcp vs this |", "| --- | --- | --- | --- | --- |"]
    floors = {"save": med.get("raw save"), "load": med.get("raw load"),
              "resharded": med.get("raw load, every process's bytes, half kept", med.get("raw load"))}
    for name, seconds in med.items():
        floor = floors["save" if "save" in name else "resharded" if "resharded" in name else "load"]
        mine = med.get("bcp save" if "save" in name else "bcp load resharded" if "resharded" in name else "bcp load")
        against = "" if name.startswith(("bcp", "raw")) or mine is None else f"{seconds / mine:.2f}x"
        rows.append(f"| {name} | {seconds:.2f} | {gb / seconds:.2f} | "
                    f"{'' if floor is None else f'{floor / seconds:.2f}x'} | {against} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--io-threads", type=int, help="bcp's and DCP's I/O threads (default: bcp's default)")
    parser.add_argument("--max-requests", type=int, nargs="+",
                        help="the S3 backend's caps on requests in flight to try (default: its default)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", nargs="+", metavar="NAME",
                        help="run only these cases (names as in the table) and the saves they load from")
    parser.add_argument("--json", help="where to write the raw timings")
    args = parser.parse_args()
    import s3_test_server as seaweedfs

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="bcp-s3-bench-") as directory:
        server = seaweedfs.start(directory)
        try:
            config = {"size_bytes": int(args.size_mb * (1 << 20)), "reps": args.reps, "io_threads": args.io_threads,
                      "max_requests": args.max_requests, "cases": args.cases,
                      "env": server.env(), "bucket": seaweedfs.BUCKET, "run": uuid.uuid4().hex[:6]}
            results = {w: launch(cases, w, config, timeout_s=3000) for w in args.worlds}
        finally:
            seaweedfs.stop(server)
    print(f"state {shapes_nbytes(gpt_shapes(config['size_bytes'])) / 1e6:.0f} MB, {args.reps} reps, "
          f"io_threads {args.io_threads or 'default'}, max_requests {args.max_requests or 'default'}; started "
          f"{started} UTC, load average {' '.join(f'{x:.1f}' for x in load_before)} before and "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} after\n")
    for world, result in results.items():
        print(table(world, result) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(w): r for w, r in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
