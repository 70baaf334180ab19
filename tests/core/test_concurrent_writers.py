"""Independent writers and readers of one checkpoint path: two processes saving at once (a job and
its accidental restart) never destroy the last good checkpoint: each claims its own generation, at
most one commit per generation, and retention keeps the newest two committed generations, so a
reader of the previous one is not broken by a concurrent save.

Guards two past defects: two writers could pick the same generation, one overwrote the other's
manifest and retention then deleted the checkpoint saved before the race, leaving a path whose only
generation failed its commit marker's checksum; and a writer's retention deleted the generation
another process was still reading ("data file ... is missing")."""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import bcp
from bcp.api.location import resolve
from bcp.engine.location import METRICS_DIR
from bcp.storage import LocalStorage
from bcp.tools import open_checkpoint
from bcp.tools.verify import verify_checkpoint

ROUNDS = 12
CALL_TIMEOUT_S = 300
NUMEL = 1 << 20  # 4 MB per save: long enough for two saves to overlap


def _state(tag: int) -> dict:
    return {"model": {"w": torch.full((NUMEL,), float(tag))}, "extra_state": {"tag": tag}}


def _tag_of(path: Path, generation: int | None = None) -> int:
    checkpoint = open_checkpoint(path, generation=generation)
    w = checkpoint.read("model/w")
    tag = checkpoint.read_object("extra_state")["tag"]
    assert torch.equal(w, torch.full((NUMEL,), float(tag))), "a generation mixes two writers' bytes"
    return tag


_barrier = None


def _start(barrier) -> None:
    global _barrier
    _barrier = barrier


def _save_at_once(path: str, tag: int) -> str:
    """In a writer process: wait for the other writer, then save."""
    _barrier.wait()
    try:
        bcp.save(path, _state(tag))
    except bcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _within(pending: "multiprocessing.pool.AsyncResult", what: str) -> Any:
    """The result of a call in the pool's processes; an AssertionError naming ``what`` if it hangs."""
    try:
        return pending.get(timeout=CALL_TIMEOUT_S)
    except multiprocessing.TimeoutError:
        raise AssertionError(f"{what} did not return within {CALL_TIMEOUT_S}s: it hangs") from None


def test_two_processes_saving_at_once_never_lose_the_last_good_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    bcp.save(path, _state(0))
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    with context.Pool(2, initializer=_start, initargs=(barrier,)) as writers:
        for round_ in range(1, ROUNDS + 1):
            tags = [2 * round_, 2 * round_ + 1]
            results = _within(writers.starmap_async(_save_at_once, [(str(path), tag) for tag in tags]),
                              f"round {round_}'s two saves")
            assert _tag_of(path) in tags, f"round {round_}: the newest checkpoint is not one of this round's"
            assert results == ["ok", "ok"], f"round {round_}: {results}"  # each wrote its own generation
            committed = [g for g, done in open_checkpoint(path).generations() if done]
            assert len(committed) >= 2, f"round {round_}: retention kept {committed}"
            for generation in committed:
                assert verify_checkpoint(path, generation=generation).ok
                assert _tag_of(path, generation) <= tags[-1]


def test_a_reader_of_the_previous_generation_survives_a_concurrent_save(tmp_path):
    path = tmp_path / "ckpt"
    bcp.save(path, _state(1))
    reader = open_checkpoint(path)  # a reader that has opened generation 1 and reads on
    context = multiprocessing.get_context("spawn")
    with context.Pool(1, initializer=_start, initargs=(context.Barrier(1),)) as writer:
        assert _within(writer.apply_async(_save_at_once, (str(path), 2)), "the concurrent save") == "ok"
    assert open_checkpoint(path).generation == 2
    assert torch.equal(reader.read("model/w"), torch.full((NUMEL,), 1.0))
    assert reader.read_object("extra_state") == {"tag": 1}


class _SavesWhileOpening(LocalStorage):
    """Local files; the first time a commit marker is read, ``saves`` new saves commit first: the
    interleaving of a reader opening generation g while writers commit g+1 and g+2."""

    def __init__(self, root: Path, saves: int) -> None:
        super().__init__(root)
        self.saves = saves

    def read_bytes(self, name: str) -> bytes:
        if name.endswith("COMMITTED") and self.saves:
            for tag in range(self.saves):
                bcp.save(LocalStorage(self.root), _state(10 + tag))
            self.saves = 0
        return super().read_bytes(name)


def test_a_reader_whose_generation_is_retired_while_opening_takes_the_newest(tmp_path):
    bcp.save(tmp_path, _state(1))
    location = resolve(_SavesWhileOpening(tmp_path, saves=2), None)  # generation 1 is retired by the second
    generation, manifest, _ = location.read_latest_manifest_files()
    assert generation == 3 and b'"generation":3' in manifest

    with pytest.raises(bcp.CheckpointNotCommittedError, match="removed while it was being opened"):
        resolve(_SavesWhileOpening(tmp_path, saves=2), None).read_manifest_files(3)


def test_retention_keeps_the_configured_number_of_committed_generations(tmp_path):
    for tag in range(4):
        bcp.save(tmp_path / "default", _state(tag))
    assert sorted(os.listdir(tmp_path / "default")) == [METRICS_DIR, "gen-00000003", "gen-00000004"]

    # Generations 1-8 by several writers: 2 and 5 never committed (failed), 8 is still being written.
    for generation in range(1, 9):
        folder = tmp_path / "mixed" / f"gen-{generation:08d}"
        folder.mkdir(parents=True)
        if generation not in (2, 5, 8):
            (folder / "COMMITTED").write_text("{}")
    location = resolve(tmp_path / "mixed", None, keep_generations=3)
    location.apply_retention(7)
    # 5 may be a slow writer's save in progress: only generations older than the oldest kept go
    assert sorted(os.listdir(tmp_path / "mixed")) == [f"gen-{g:08d}" for g in (4, 5, 6, 7, 8)]
    with pytest.raises(bcp.CheckpointError, match="keep_generations"):
        resolve(tmp_path, None, keep_generations=0)
