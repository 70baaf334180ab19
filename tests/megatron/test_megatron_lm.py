"""Opt-in: a Megatron-LM checkout named by ``BCP_MEGATRON_LM`` (0.16 or 0.17). Its Megatron-Core
round-trips a GPTModel through bcp on the CPU; with Megatron-LM's requirements installed the
launcher's routes are checked; with two CUDA devices its own ``pretrain_gpt.py`` trains with
``--ckpt-format bcp`` through ``python -m bcp_megatron.launch`` and resumes at another TP size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

CHECKOUT = os.environ.get("BCP_MEGATRON_LM")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="set BCP_MEGATRON_LM to a Megatron-LM checkout to run")

ROUTE_CHECK = """
import sys
try:
    import megatron.training.checkpointing as checkpointing
except ModuleNotFoundError as exc:
    sys.exit(f"MISSING {exc}")
from bcp_megatron import BcpLoadShardedStrategy, BcpSaveShardedStrategy
from bcp_megatron.launch import install_routes
install_routes(checkpointing)
if hasattr(checkpointing, "get_default_save_sharded_strategy"):  # Megatron-LM 0.16
    assert isinstance(checkpointing.get_default_save_sharded_strategy("torch_dist"), BcpSaveShardedStrategy)
else:  # 0.17
    assert isinstance(checkpointing.TorchDistSaveShardedStrategy(), BcpSaveShardedStrategy)
    assert isinstance(checkpointing.TorchDistLoadShardedStrategy(cache_metadata=True), BcpLoadShardedStrategy)
"""
CORE_CASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_checkout_case.py")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--lr", "1e-4",
         "--log-interval", "1", "--eval-iters", "0", "--save-interval", "2", "--use-distributed-optimizer"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")]))}


def test_launcher_routes_this_checkouts_saves_to_bcp():
    done = subprocess.run([sys.executable, "-c", ROUTE_CHECK], env=_env(), capture_output=True, text=True,
                          timeout=300)
    missing = [line for line in done.stderr.splitlines() if line.startswith("MISSING ")]
    if missing:
        pytest.skip(f"Megatron-LM's training requirements are not installed: {missing[0][8:]}")
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_checkouts_megatron_core_round_trips_bcp(tmp_path):
    """Megatron-Core as the checkout ships it (0.16 registry or 0.17 torch_dist subclasses), on the CPU."""
    from megatron_parts import assemble, assert_bitwise

    done = subprocess.run([sys.executable, CORE_CASE, str(tmp_path)], env={**_env(), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]  # written by the case
    assert_bitwise(assemble([r["saved"] for r in ranks]), assemble([r["loaded"] for r in ranks]))
    for key in ("metadata", "wrapped metadata"):
        assert json.loads(ranks[0][key])["sharded_backend"] == "bcp"
    outcome = ranks[0]["torch_dist through bcp's load strategy"]
    registry = ranks[0]["version"].startswith("0.16")  # 0.16 dispatches on metadata.json before the strategy
    assert outcome.startswith("refused") and "'torch_dist'" in outcome if registry else outcome == "loaded"


def _train(ckpt: str, tp: int, iters: int) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "bcp_megatron.launch",
               os.path.join(CHECKOUT, "pretrain_gpt.py"), *MODEL, "--ckpt-format", "bcp",
               "--tensor-model-parallel-size", str(tp), "--train-iters", str(iters), "--save", ckpt, "--load", ckpt]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done.stdout + done.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Megatron-LM's training needs two CUDA devices")
def test_pretrain_gpt_saves_bcp_and_resumes_at_another_tensor_parallel_size(tmp_path):
    import bcp.tools

    ckpt = str(tmp_path / "ckpt")
    _train(ckpt, tp=2, iters=4)
    saved = os.path.join(ckpt, "iter_0000004")
    assert json.load(open(os.path.join(saved, "metadata.json")))["sharded_backend"] == "bcp"
    assert bcp.tools.verify_checkpoint(saved).ok
    log = _train(ckpt, tp=1, iters=6)
    assert "at iteration 4" in log
    assert bcp.tools.verify_checkpoint(os.path.join(ckpt, "iter_0000006")).ok
