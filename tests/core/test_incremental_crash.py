"""A process SIGKILLed during an incremental save (a process of this test's own, killed at an exact
point by itself): the previous generation stays the newest and loads bitwise, with the bytes of the
earlier generation it refers to; the next save (a new process, remembering nothing) commits and its
retention removes the dead save's files but not the bytes the kept generations refer to."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

import bcp
from dying_coordinator import die
from lora_models import build_lora
from models import assert_bitwise, full_state, train

pytestmark = pytest.mark.distributed  # processes of its own, outside the rank pool


def _saves(root: str, death: str) -> None:
    """Generations 1 (whole) and 2 (incremental, referring to 1) committed; generation 3 dies."""
    torch.set_num_threads(1)
    model, optimizer = build_lora("plain", seed=1)
    state = {"model": model, "optimizer": optimizer}
    for save in range(2):
        train(model, optimizer, range(save, save + 1))
        bcp.save(root, state, incremental=True, keep_generations=1)
    torch.save(full_state(model, optimizer), os.path.join(root, "expected-2.pt"))
    train(model, optimizer, range(2, 3))
    with torch.no_grad():
        model.base2.weight[0] += 1  # the third save writes a frozen tensor again, beside the adapters
    torch.save(full_state(model, optimizer), os.path.join(root, "expected-3.pt"))
    from bcp.storage.local import LocalStorage

    if death == "writing":  # the data file half written
        real_write = LocalStorage.write_file

        def write_file(self, name, views):
            def first_then_die():
                for index, view in enumerate(views):
                    if index == 1:
                        die()
                    yield view
            return real_write(self, name, first_then_die())
        LocalStorage.write_file = write_file
    elif death == "marking":  # data, shard table and manifest written, the commit marker not
        real_put = LocalStorage.put_if_absent
        LocalStorage.put_if_absent = lambda self, name, data: die() if name.endswith("COMMITTED") else \
            real_put(self, name, data)
    elif death == "retiring":  # committed; retention removing the older generations
        LocalStorage.delete_tree = lambda self, name: die()
    bcp.save(root, state, incremental=True, keep_generations=1)


def _generations(root: str) -> list[int]:
    return sorted(int(name[4:]) for name in os.listdir(root) if name.startswith("gen-"))


def _loaded(root: str, **options) -> dict:
    model, optimizer = build_lora("plain", seed=2)
    train(model, optimizer, range(1))
    result = bcp.load(root, {"model": model, "optimizer": optimizer}, **options)
    return {"generation": result.generation, "state": full_state(model, optimizer)}


@pytest.mark.parametrize("death,survives", [("writing", 2), ("marking", 2), ("retiring", 3)])
def test_an_incremental_save_killed_midway_leaves_a_loadable_checkpoint(tmp_path, death, survives):
    root = str(tmp_path)
    process = mp.get_context("spawn").Process(target=_saves, args=(root, death))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == -signal.SIGKILL, f"the save did not die as planned: {process.exitcode}"
    assert _generations(root) == [1, 2, 3]  # 1 stays: 2 refers to its bytes
    loaded = _loaded(root)
    assert loaded["generation"] == survives
    assert_bitwise(torch.load(os.path.join(root, f"expected-{survives}.pt")), loaded["state"])
    assert bcp.tools.verify_checkpoint(root).ok

    model, optimizer = build_lora("plain", seed=3)  # a new process's save: the base's manifest decides
    bcp.load(root, {"model": model, "optimizer": optimizer})
    handle = bcp.save(root, {"model": model, "optimizer": optimizer}, incremental=True, keep_generations=1)
    assert handle.stats.reused_bytes > 0
    # the dead save's files are gone; the kept generation refers to the base's and to generation 1's
    assert _generations(root) == [1, survives, 4]
    assert_bitwise(loaded["state"], _loaded(root)["state"])
    assert bcp.tools.verify_checkpoint(root).ok
