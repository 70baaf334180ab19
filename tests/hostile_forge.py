"""Forging checkpoints for the hostile-input tests: a small real checkpoint, and rewriting its
metadata so that a forged manifest still matches its commit marker (the forgery reaches the parser
instead of failing the marker's checksum)."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from crc32c import crc32c

import bcp
from bcp.layout.shards import TensorShard

GEN = "gen-00000001"


def live_state() -> dict[str, Any]:
    """A state with a two-shard tensor, a bfloat16 one and values of several encoded types."""
    w = torch.arange(12.0).reshape(4, 3)
    return {
        "model": {"w": [TensorShard(w[:2].clone(), (4, 3), (0, 0)), TensorShard(w[2:].clone(), (4, 3), (2, 0))],
                  "b": torch.ones(5, dtype=torch.bfloat16)},
        "extra_state": {"step": 3, "x": torch.ones(2, 2), "a": np.arange(3), "s": {1, 2}, "by": b"xy",
                        "t": (1.5, float("inf"))},
    }


def empty_state() -> dict[str, Any]:
    """What a load of :func:`live_state`'s checkpoint fills."""
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.bfloat16)}, "extra_state": None}


def make_checkpoint(path: Path) -> Path:
    bcp.save(path, live_state())
    return path


def files(path: Path, gen: str = GEN) -> tuple[bytes, bytes, bytes]:
    """The manifest, shard table and marker bytes of a generation."""
    root = Path(path) / gen
    return ((root / "manifest.json").read_bytes(), (root / "shard_table.bin").read_bytes(),
            (root / "COMMITTED").read_bytes())


def write_signed(path: Path, manifest: bytes, table: bytes | None = None, gen: str = GEN) -> None:
    """Write ``manifest`` (and ``table``) and a marker that matches the manifest's size and crc."""
    root = Path(path) / gen
    if table is not None:
        (root / "shard_table.bin").write_bytes(table)
    (root / "manifest.json").write_bytes(manifest)
    marker = json.loads((root / "COMMITTED").read_bytes())
    marker.update(manifest_bytes=len(manifest), manifest_crc32c=crc32c(manifest))
    (root / "COMMITTED").write_text(json.dumps(marker))


def forge(path: Path, change: Any, gen: str = GEN) -> None:
    """Apply ``change(doc)`` to the manifest document and write it signed."""
    root = Path(path) / gen
    doc = json.loads((root / "manifest.json").read_bytes())
    change(doc)
    write_signed(path, json.dumps(doc).encode(), gen=gen)


def sign_table(doc: dict, table: bytes) -> None:
    """Make the manifest's shard-table record match ``table``'s size and crc."""
    doc["shard_table"].update(nbytes=len(table), crc32c=crc32c(table))


def forge_value(path: Path, name: str, tree: bytes, blobs: bytes = b"", gen: str = GEN) -> None:
    """Replace value ``name``'s record with ``tree`` + ``blobs``, appended to its data file, with
    correct checksums: only the record's content is hostile."""
    root = Path(path) / gen
    doc = json.loads((root / "manifest.json").read_bytes())
    record = doc["objects"][name]["records"][0]
    data_file = root / doc["files"][record[0]]
    offset = os.path.getsize(data_file)
    payload = tree + blobs
    with open(data_file, "ab") as f:
        f.write(payload)
    chunk = doc["checksum"]["chunk_bytes"]
    crcs = [crc32c(payload[i:i + chunk]) for i in range(0, max(1, len(payload)), chunk)]
    doc["objects"][name]["records"][0] = [record[0], offset, len(payload), len(tree), crcs]
    write_signed(path, json.dumps(doc).encode(), gen=gen)


class CappedChild:
    """A spawned process whose address space is capped at what it holds after importing bcp plus
    ``headroom``: a case that would allocate what a forged size claims fails there with a
    ``MemoryError`` instead of taking the machine's memory, and a call that hangs is cut off."""

    def __init__(self, headroom: int = 2 << 30) -> None:
        self.headroom = headroom
        self.pool = self._start()

    def _start(self) -> Any:
        return multiprocessing.get_context("spawn").Pool(1, initializer=_cap_memory, initargs=(self.headroom,))

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 300) -> Any:
        """``fn(*args)`` in the child (``fn`` module-level); AssertionError if it runs past ``timeout``
        (the hung child is replaced by a fresh one for the next call)."""
        try:
            return self.pool.apply_async(fn, args).get(timeout=timeout)
        except multiprocessing.TimeoutError:
            self.pool.terminate()
            self.pool = self._start()
            raise AssertionError(f"{fn.__name__}{args!r} did not return within {timeout} s: it hangs") from None

    def __enter__(self) -> "CappedChild":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.terminate()


def _cap_memory(headroom: int) -> None:
    import torch  # noqa: F401 - imported before the cap: its libraries are mapped once, here

    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))


def outcome(fn: Callable[[], Any]) -> str:
    """``"ok"``, or the exception's class and message: what a test asserts on."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the class is the result
        return f"{type(exc).__name__}: {exc}"
    return "ok"
