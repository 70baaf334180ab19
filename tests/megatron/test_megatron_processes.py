"""Megatron's own asynchronous queue and torch_dist backend next to bcp, in two ranks started for
these cases (see megatron_processes.py): one launch runs them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_parts import assemble, assert_bitwise
from process_checks import own_process_group

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_processes.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("megatron_processes")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A process group of its own, so that a timeout ends the ranks and their forked writers too.
    proc = subprocess.Popen([sys.executable, SCRIPT, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **own_process_group())
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    per_rank = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]  # written by the test itself
    for rank in per_rank:
        for case, value in rank.items():
            assert "error" not in value, f"{case}: {value.get('error')}"
    return per_rank


def test_async_save_through_megatrons_queue_keeps_the_snapshot(results):
    cases = [r["async_save_keeps_its_snapshot"] for r in results]
    assert_bitwise(assemble([c["snapshot"] for c in cases]), assemble([c["loaded"] for c in cases]))
    assert json.loads(cases[0]["metadata"])["sharded_backend"] == "bcp"


def test_torch_dist_and_bcp_checkpoints_are_not_confused(results):
    cases = [r["backends_are_not_confused"] for r in results]
    saved = assemble([c["saved"] for c in cases])
    for backend in ("torch_dist", "bcp"):
        assert_bitwise(saved, assemble([c[f"default load of {backend}"] for c in cases]))
    case = cases[0]
    assert case["BcpLoadShardedStrategy on torch_dist"].startswith("FormatVersionError")  # also a CheckpointingException
    assert "'torch_dist' backend" in case["BcpLoadShardedStrategy on torch_dist"]
    assert case["TorchDistLoadShardedStrategy on bcp"] != "loaded"
    assert case["bcp.load on torch_dist"].startswith("CheckpointNotFoundError")
