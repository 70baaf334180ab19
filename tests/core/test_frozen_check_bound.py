"""Incremental saves bound how long a write behind torch's version counter to a frozen tensor goes
unseen: every checksum chunk of a frozen, untouched tensor is checked within
``FROZEN_CHECK_SAVES`` consecutive saves, whatever its size (``docs/incremental.md``). Here a
one-row write through ``.data`` to a 64 MiB frozen weight, in the chunk checked last, reaches the
checkpoint at the 16th save after it and not before. (A 1 GiB weight was measured by hand the same
way: caught at the 16th save; each save checked 64 MiB of it.)

Guards a past defect: one chunk was checked per save, so a write to a 49 MiB weight reached the
checkpoint only at the 48th save after it."""

from __future__ import annotations

import torch
from torch import nn

import bcp
import bcp.tools
from bcp.planning.reuse import FROZEN_CHECK_SAVES, checked_chunks

CHUNK = 1 << 20
ROW_BYTES = 4096 * 4


def test_every_chunk_is_checked_within_the_bound_and_small_tensors_every_save():
    for chunks in (1, 2, 15, 16, 17, 64, 1024):
        seen = [set(checked_chunks(g, chunks)) for g in range(7, 7 + min(FROZEN_CHECK_SAVES, chunks))]
        assert set().union(*seen) == set(range(chunks)) and all(seen)


def test_a_one_row_write_through_data_to_a_64_mib_frozen_weight_is_saved_within_the_bound(tmp_path):
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 4))
    model[0].requires_grad_(False)
    state = {"model": model}
    base = bcp.save(tmp_path, state, incremental=True).generation
    last_checked = base + FROZEN_CHECK_SAVES
    chunk = next(c for c in range(64) if c in checked_chunks(last_checked, 64))
    row = chunk * CHUNK // ROW_BYTES + 3
    model[0].weight.data[row] += 1  # .data: the parameter's version counter does not move
    for _ in range(FROZEN_CHECK_SAVES - 1):
        bcp.save(tmp_path, state, incremental=True)
    saved = bcp.tools.read_tensor(tmp_path, "model/0.weight")
    assert not torch.equal(saved[row], model[0].weight[row])  # its chunk was not checked yet
    assert bcp.save(tmp_path, state, incremental=True).generation == last_checked
    assert torch.equal(bcp.tools.read_tensor(tmp_path, "model/0.weight"), model[0].weight)
