"""Lossless compression, in a fresh process, on states with trained weights (``trained.py``): the bf16
weights of an MLP trained in the run, and its mixed-precision training checkpoint. On each state,
side by side: every codec considered, alone on the state's 1 MiB chunks (``codecs.py``); then whole
checkpoints on the local disk: bcp uncompressed, bcp compressed, DCP, and DCP with its zstd stream
extension (saves fsync'd, loads cold, each checked bit for bit once); then bcp uncompressed and
compressed on S3 (a SeaweedFS server on 127.0.0.1, started here as the tests start it), reached
directly and through an emulated network link that paces bytes (``paced_link.py``, in a process
of its own). Interleaved repetitions (uncompressed, compressed, compressed, uncompressed, ...),
medians and their spread; "MB/s per core" is the state's raw bytes over this process's CPU seconds."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import bcp
import torch

from bcpbench import codecs, disk
from bcpbench.paced_link import PacedLink
from bcpbench.methods import Bcp, Dcp
from bcpbench.record import Record, rotated
from bcpbench.rounds import assert_equal, slug
from bcpbench.trained import BF16, MIXED, PARTS, part_of, train

CODEC = "zstd"  # what bcp.save(..., compression=...) is given
BCP, BCP_COMPRESSED = "bcp", f"bcp, compression={CODEC!r}"
DCP, DCP_ZSTD = "DCP", "DCP, zstd extension"
LOCAL, S3 = "local disk", "S3 (SeaweedFS)"
# An emulated network link to the same server (``paced_link.py``): 250 MB/s each way, 2 Gbit/s, a
# process's share of a node's NIC; on loopback, bytes cost nothing and compression cannot pay.
LINK_MB_S = 250
PACED = f"S3 (SeaweedFS) through a {LINK_MB_S} MB/s emulated link"
# Rounds on S3, whatever the profile's repetitions: one save there takes 0.2-3 s with a spread of
# up to 2.5x between rounds on the shared 2-core machine (the server's disk and the other processes),
# so fewer rounds leave a median that the next run contradicts.
S3_ROUNDS = 7
TRAINING, CODECS, STORED, CPU = ("compression: training", "compression: codecs", "compression: stored bytes",
                                 "compression: CPU seconds")
TESTS = os.path.join(os.path.dirname(__file__), "..", "..", "tests")  # the SeaweedFS launcher


def case(state: str, what: str, where: str) -> str:
    return f"compression, {state}: {what}, {where}"


def bcp_compresses() -> bool:
    """Whether the bcp measured has ``SaveOptions.compression``."""
    return "compression" in {f.name for f in dataclasses.fields(bcp.SaveOptions)}


def compressed_ratio(record: Record, label: str, method: str = BCP_COMPRESSED) -> float | None:
    """The state's raw bytes over the bytes of ``method``'s checkpoint files on the local disk."""
    stored = record.figures.get(STORED, {}).get(label, {}).get(method)
    raw = record.nbytes.get(case(label, "save", LOCAL))
    return raw / stored if stored and raw else None


def time_ratio(record: Record, label: str, what: str, where: str) -> float | None:
    """Uncompressed bcp's median seconds over compressed bcp's (above 1: compressed is faster)."""
    plain, compressed = (record.median(case(label, what, where), m) for m in (BCP, BCP_COMPRESSED))
    return plain / compressed if plain and compressed else None


def run(config: dict[str, Any]) -> dict:
    record = Record()
    settings = config["compression"]
    trained = train(settings["width"], settings["layers"], settings["steps"], settings["batch"], settings["lr"])
    record.figures[TRAINING] = {**settings, **trained.figures, "bcp_compresses": bcp_compresses()}
    io = config["io_threads"]
    savers = [Bcp(io_threads=io), Dcp(), Dcp(zstd=True)]
    if bcp_compresses():
        savers.insert(1, Bcp(BCP_COMPRESSED, io_threads=io, compression=CODEC))
    reps = config["reps"]
    for label, state in trained.states.items():
        _codecs(record, label, state, max(1, min(reps, 3)))
        root = os.path.join(config["workdir"], "compression")
        _rounds(record, label, LocalDisk(root), savers, state, reps)
        disk.remove(root)
    _on_s3(record, trained.states, [s for s in savers if s.name.startswith(BCP)], max(reps, S3_ROUNDS),
           config["workdir"])
    bcp.shutdown()
    return record.to_dict()


def _codecs(record: Record, label: str, state: dict[str, torch.Tensor], reps: int) -> None:
    pieces = codecs.chunks(state, part_of)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per codec, whatever the library would take
    try:
        record.figures.setdefault(CODECS, {})[label] = {c.name: codecs.measure(c, pieces, reps)
                                                        for c in codecs.considered()}
    finally:
        torch.set_num_threads(torch_threads)


class LocalDisk:
    """Checkpoints in folders under ``root``; cold loads read them evicted from the page cache."""

    where = LOCAL

    def __init__(self, root: str) -> None:
        self.root = root

    def target(self, name: str) -> str:
        return os.path.join(self.root, name)

    def before_load(self, target: str) -> None:
        disk.evict(target)

    def stored_bytes(self, target: str) -> int | None:
        return sum(os.path.getsize(p) for p in disk.files_under(target))

    def remove(self, target: str) -> None:
        disk.remove(target)


class SeaweedFs:
    """Checkpoints under prefixes of the server's bucket; cold loads read its files evicted."""

    def __init__(self, server: Any, bucket: str, link: PacedLink | None = None) -> None:
        self.server, self.base = server, f"s3://{bucket}/bench-{uuid.uuid4().hex[:6]}"
        self.where, self.endpoint = (S3, None) if link is None else (PACED, link.endpoint)

    def target(self, name: str) -> Any:
        from bcp.storage import S3Storage

        return S3Storage(f"{self.base}/{name}", **self.server.options(self.endpoint))

    def before_load(self, target: Any) -> None:
        disk.evict(self.server.directory)

    def stored_bytes(self, target: Any) -> int | None:
        return None  # the local disk's figure: the same bytes

    def remove(self, target: Any) -> None:
        target.delete_tree("")


def _rounds(record: Record, label: str, place: Any, savers: list[Any], state: dict[str, torch.Tensor],
            reps: int) -> None:
    """Each repetition saves and cold-loads with every saver in a rotating order; the untimed first
    checks every load bit for bit."""
    dest = {n: torch.zeros_like(t) for n, t in state.items()}
    save_case, load_case = case(label, "save", place.where), case(label, "cold load", place.where)
    for rep in range(-1, reps):
        for saver in rotated(savers, max(rep, 0)):
            target = place.target(f"{slug(saver.name)}-{rep + 1}")
            save_s, save_cpu, _ = cpu_timed(lambda: saver.save(target, state))
            stored = place.stored_bytes(target)
            if rep < 0:
                for tensor in dest.values():
                    tensor.zero_()
            place.before_load(target)
            load_s, load_cpu, _ = cpu_timed(lambda: saver.load(target, dest))
            place.remove(target)
            if rep < 0:
                assert_equal(dest, state, f"{saver.name}, {load_case}")
                continue
            record.add(save_case, saver.name, save_s)
            record.add(load_case, saver.name, load_s)
            for which, seconds in ((save_case, save_cpu), (load_case, load_cpu)):
                record.figures.setdefault(CPU, {}).setdefault(which, {}).setdefault(saver.name, []).append(seconds)
            if stored is not None:
                record.figures.setdefault(STORED, {}).setdefault(label, {})[saver.name] = stored
    record.nbytes[save_case] = record.nbytes[load_case] = sum(t.numel() * t.element_size() for t in state.values())


def _on_s3(record: Record, states: dict[str, dict[str, torch.Tensor]], savers: list[Any], reps: int,
           workdir: str) -> None:
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    import s3_test_server as seaweedfs

    with tempfile.TemporaryDirectory(prefix="bcp-bench-seaweedfs-", dir=workdir) as directory:
        server = seaweedfs.start(directory)
        link = PacedLink(server.endpoint, LINK_MB_S)
        try:
            for label, state in states.items():
                _rounds(record, label, SeaweedFs(server, seaweedfs.BUCKET), savers, state, reps)
                _rounds(record, label, SeaweedFs(server, seaweedfs.BUCKET, link), savers, state, reps)
        finally:
            link.close()
            seaweedfs.stop(server)


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall seconds, this process's CPU seconds (all its threads) and the result of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result
