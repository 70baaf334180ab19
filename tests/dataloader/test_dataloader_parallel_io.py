"""A rank's dataloader parts are written and read side by side, not one after another (the paper's
dataloader stragglers, section 6.4). Proved by overlap, not by timing: a storage that counts the
data-file calls in flight makes the first call wait until a second one has started, so calls made
one after another never overlap and the count stays 1."""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import bcp
from bcp.storage.local import LocalStorage
from dataloader_streams import loader

TOKENS = 4 << 20  # int64: 32 MB per read worker, so two workers' parts go to two data files


class OverlapRecorder(LocalStorage):
    """A local directory that records how many data-file reads or writes are in flight at once."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._lock = threading.Lock()
        self._in_flight = 0
        self.most_in_flight = {"read": 0, "write": 0}
        self._second = {"read": threading.Event(), "write": threading.Event()}

    def _calls(self, kind: str, name: str, call):
        if "/data/" not in f"/{name}":
            return call()
        with self._lock:
            self._in_flight += 1
            self.most_in_flight[kind] = max(self.most_in_flight[kind], self._in_flight)
            if self._in_flight >= 2:
                self._second[kind].set()
        try:
            # The timeout only bounds a failing run (one call at a time never sets the event), and
            # setting it then lets the later calls of that run go on without waiting.
            if not self._second[kind].wait(timeout=10):
                self._second[kind].set()
            return call()
        finally:
            with self._lock:
                self._in_flight -= 1

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        self._calls("write", name, lambda: super(OverlapRecorder, self).write_file(name, chunks))

    def read_into_many(self, name: str, offset: int, dests: Sequence[memoryview]) -> None:
        self._calls("read", name, lambda: super(OverlapRecorder, self).read_into_many(name, offset, dests))


def _state(buffers: list[list[int]] | None = None) -> dict:
    mine = loader(0, 1)
    for reader, buffer in zip(mine.readers, buffers or []):
        reader.buffer = buffer
    return {"dataloader": bcp.DataloaderState(mine, dp_rank=0, dp_size=1)}


def test_one_ranks_dataloader_parts_are_written_concurrently(tmp_path):
    storage = OverlapRecorder(str(tmp_path / "ckpt"))
    big = [list(range(w * TOKENS, (w + 1) * TOKENS)) for w in (0, 1)]
    bcp.save(storage, _state(big))
    assert storage.most_in_flight["write"] >= 2


def test_one_ranks_dataloader_parts_are_read_concurrently_and_load_back(tmp_path):
    bcp.save(str(tmp_path / "ckpt"), _state([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]))
    storage = OverlapRecorder(str(tmp_path / "ckpt"))
    state = _state()
    bcp.load(storage, state)
    assert storage.most_in_flight["read"] >= 2
    assert [r.buffer for r in state["dataloader"].loader.readers] == [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
