"""The Lightning and Accelerate flows with bcp, in fresh processes: every rank exits 0, each flow
several times (see ``test_process_exit.py`` for why fresh processes and repetitions)."""

from __future__ import annotations

import pytest

from zygote import Zygote

REPEATS = 3


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(preload=("lightning", "accelerate", "bcp_lightning", "bcp_accelerate", "framework_jobs"))
    yield z
    z.close()


def _all_zero(result) -> None:
    assert result.clean, result.describe()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_lightning_fit_and_resume_with_bcp_exits_zero(zygote, tmp_path, async_save):
    for repeat in range(REPEATS):
        _all_zero(zygote.run("framework_jobs:lightning_fit_then_leave", 2, str(tmp_path / f"run{repeat}"),
                             async_save, timeout=180))


def test_accelerate_save_and_load_state_with_bcp_exit_zero(zygote, tmp_path):
    for repeat in range(REPEATS):
        result = zygote.run("framework_jobs:accelerate_save_load_then_leave", 2, str(tmp_path / f"state{repeat}"),
                            timeout=180, env={"ACCELERATE_CHECKPOINT_ENGINE": "bcp"})
        _all_zero(result)
        assert (tmp_path / f"state{repeat}").exists()
