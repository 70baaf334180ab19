"""A failed or abandoned save leaves nothing behind. Where every rank reported the end of its
writes, its generation is removed whole at once; where that is unknown (a rank died or hung, and
might still write), its files go, its claim stays, marked, so that its number is not handed out
again meanwhile, and the next commit removes it. A generation another writer is still saving is
never removed by those rules.

Guards a defect where a failed generation's folder, holding only its claim, stayed on disk after
the next save (and after every later one, until it fell out of the generations kept)."""

from __future__ import annotations

import os

import pytest
import torch

import bcp
from bcp.engine.location import CLAIM, METRICS_DIR
from bcp.integration import checkpoint_location


class FullAfter(bcp.LocalStorage):
    """A local disk that fails every data file: a save that fails in its writes on every rank."""

    def write_file(self, name, chunks):
        if "/data/" in name:
            raise OSError(28, "No space left on device")
        super().write_file(name, chunks)


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((1024,), value)}, "extra_state": {"value": value}}


def _folders(path) -> list[str]:
    return sorted(name for name in os.listdir(path) if name != METRICS_DIR)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_failed_on_every_rank_is_removed_whole_at_once(tmp_path, async_save):
    bcp.save(tmp_path, _state(1.0))
    with pytest.raises(bcp.StorageError, match="No space left on device"):
        bcp.save(FullAfter(str(tmp_path)), _state(2.0), async_save=async_save).wait()
    assert _folders(tmp_path) == ["gen-00000001"]
    assert bcp.save(tmp_path, _state(3.0)).generation == 2  # the number of the failed one, now free


def test_a_failed_save_whose_writers_may_still_write_keeps_its_marked_claim_until_the_next_commit(tmp_path):
    bcp.save(tmp_path, _state(1.0))
    location = checkpoint_location(str(tmp_path), None)
    failed = location.claim_next_generation()
    location.storage.write_file(location.name(failed, "data/00001-00.bin"), [memoryview(b"partial")])
    location.discard(failed, every_writer_stopped=False)  # a rank died: its writes' end is unknown
    assert sorted(os.listdir(tmp_path / "gen-00000002")) == [CLAIM] and location.is_discarded(failed)
    assert location.claim_next_generation() == 3  # not handed out again meanwhile
    location.discard(3, every_writer_stopped=True)
    assert bcp.save(tmp_path, _state(4.0)).generation == 3
    assert _folders(tmp_path) == ["gen-00000001", "gen-00000003"]  # the next commit removed the remains


def test_another_writers_generation_in_progress_survives_a_commit(tmp_path):
    bcp.save(tmp_path, _state(1.0))
    location = checkpoint_location(str(tmp_path), None)
    in_progress = location.claim_next_generation()  # another process's save, still writing
    location.storage.write_file(location.name(in_progress, "data/00000-00.bin"), [memoryview(b"bytes")])
    assert bcp.save(tmp_path, _state(2.0), keep_generations=3).generation == 3
    assert _folders(tmp_path) == ["gen-00000001", "gen-00000002", "gen-00000003"]
    assert not location.is_discarded(in_progress)
