"""Opt-in: Megatron-LM's own checkpointing with ``--ckpt-format bcp``, on the CPU, for the checkout
named by ``BCP_MEGATRON_LM`` (0.16 or 0.17). Needs Megatron-LM's training imports
(``pip install six triton pybind11``, see docs/megatron.md). Everything runs under ``torchrun`` (2 gloo
ranks, TP=2) through ``python -m bcp_megatron.launch``, so Megatron-LM parses ``--ckpt-format bcp``
as the launcher rewrites it; ``megatron_lm_cpu.py`` stands in for CUDA.

- ``megatron_lm_checkpointing_case.py`` builds pretrain_gpt.py's GPTModel (bf16, DistributedOptimizer)
  with Megatron-LM's ``setup_model_and_optimizer``, steps once, calls ``save_checkpoint``, and loads
  back through ``load_checkpoint`` in a new model; a second run loads the checkpoint at TP=1.
- ``megatron_lm_pretrain_case.py`` runs ``pretrain_gpt.py`` itself: 4 iterations straight through,
  then resumed at iteration 2 from its bcp checkpoint, and from a torch_dist one (continuing in bcp).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

CHECKOUT = os.environ.get("BCP_MEGATRON_LM")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="set BCP_MEGATRON_LM to a Megatron-LM checkout to run")

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = os.path.join(HERE, "megatron_lm_checkpointing_case.py")
PRETRAIN_CASE = os.path.join(HERE, "megatron_lm_pretrain_case.py")
# Vocabulary 1023 (+1 for the NullTokenizer's EOD) needs no padding at TP=1 or 2, so the embedding
# keeps its shape across the TP change. Gradient clipping asserts CUDA tensors: off.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023", "--lr", "1e-3", "--clip-grad", "0.0", "--bf16",
         "--use-distributed-optimizer", "--seed", "1234",
         "--distributed-backend", "gloo", "--use-cpu-initialization", "--transformer-impl", "local",
         "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
         "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--ckpt-format", "bcp"]
# On the CPU, dropout draws from the CPU generator, which Megatron-LM also draws from after a resume
# (its data loaders start after the checkpoint is loaded); on GPUs it draws from the checkpointed
# CUDA RNG tracker. Off, so that a resumed run can match an uninterrupted one bit for bit. Later saves
# reuse the cached strategy (--ckpt-assume-constant-structure); loads go through the fully parallel wrapper.
PRETRAIN = [*MODEL, "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--eval-iters", "0",
            "--eval-interval", "1000", "--log-interval", "1", "--save-interval", "2", "--train-iters", "4",
            "--tensor-model-parallel-size", "2", "--ckpt-assume-constant-structure", "--ckpt-fully-parallel-load"]


def megatron_lm_env() -> dict:
    """The checkout on the path; ``python3``/``python3-config`` of this interpreter first on PATH
    (Megatron-LM compiles its dataset helpers with ``make`` at start-up); one CUDA connection, which
    Megatron-LM's argument check demands with TP > 1 on pre-Blackwell devices."""
    base_bin = os.path.dirname(os.path.realpath(sys._base_executable))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")])),
            "PATH": os.pathsep.join([base_bin, os.environ.get("PATH", "")]), "OMP_NUM_THREADS": "1",
            "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.fixture(scope="module")
def training_imports():
    done = subprocess.run([sys.executable, "-c", "import megatron.training.training"], env=megatron_lm_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode:
        pytest.skip(f"Megatron-LM's training code does not import: {done.stderr.strip().splitlines()[-1]}")


def launch(script: str, *args: str, env: dict | None = None) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "bcp_megatron.launch", script, *args]
    done = subprocess.run(command, env={**megatron_lm_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=1200, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done.stdout + done.stderr


def run_case(out, phase: str, tp: int, *extra: str) -> list[dict]:
    ckpt = str(out / "ckpt")
    launch(CASE, "--case-out", str(out), "--case-phase", phase, *MODEL, "--train-iters", "10",
           "--save-interval", "1", "--save", ckpt, "--load", ckpt, "--tensor-model-parallel-size", str(tp), *extra)
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def saved(training_imports, tmp_path_factory):
    """TP=2: one step, Megatron-LM's save_checkpoint at iteration 1, its load_checkpoint into a new model."""
    out = tmp_path_factory.mktemp("megatron_lm")
    return out, run_case(out, "save", tp=2)


def whole(ranks: list[dict], at: str, part: str) -> dict:
    from megatron_parts import assemble

    return assemble([r[at][part] for r in ranks])


def test_save_checkpoint_writes_bcp_through_the_launcher(saved):
    out, ranks = saved
    assert {r["ckpt_format"] for r in ranks} == {"torch_dist"}  # the launcher's route: torch_dist's code paths
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert_bcp_checkpoint(out / "ckpt" / "iter_0000001")


def test_load_checkpoint_restores_model_optimizer_scheduler_and_rng_bitwise(saved):
    from megatron_parts import assert_bitwise

    _, ranks = saved
    for part in ("model", "optimizer"):  # optimizer: main params and Adam moments, in model space
        assert_bitwise(whole(ranks, "saved", part), whole(ranks, "loaded", part))
    for r in ranks:
        assert (r["iteration"], r["flops"]) == (1, 123)
        assert r["loaded scheduler"] == r["scheduler"]
        saved_rng, loaded_rng = r["rng"], r["loaded rng"]  # rng_state: a ShardedObject per TP rank
        assert saved_rng["tracker"].keys() == loaded_rng["tracker"].keys()
        for name in ("torch", "cuda"):
            assert torch.equal(saved_rng[name], loaded_rng[name]), name
        for name, state in saved_rng["tracker"].items():
            assert torch.equal(state, loaded_rng["tracker"][name]), name


def test_load_checkpoint_at_another_tensor_parallel_size(saved):
    """TP=2 -> TP=1 (DP=2). The optimizer is not loaded: Megatron refuses its default dp_reshardable
    format across TP, and the fully_reshardable load needs Apex or Transformer Engine (docs/megatron.md)."""
    from megatron_parts import assert_bitwise

    out, ranks = saved
    loaded = run_case(out, "load", 1, "--no-load-optim")
    assert_bitwise(whole(ranks, "saved", "model"), whole(loaded, "loaded", "model"))
    assert [r["iteration"] for r in loaded] == [1, 1]


def pretrain(losses, ckpt, *extra: str) -> tuple[str, list[dict]]:
    """pretrain_gpt.py to iteration 4 (resuming from ``ckpt`` if it holds a checkpoint); every rank's
    losses by iteration."""
    log = launch(PRETRAIN_CASE, *PRETRAIN, "--save", str(ckpt), "--load", str(ckpt), *extra,
                 env={"BCP_MEGATRON_LM": CHECKOUT, "BCP_CASE_LOSSES": str(losses)})
    return log, [torch.load(f"{losses}-rank{r}.pt") for r in range(2)]


def assert_bcp_checkpoint(path) -> None:
    import bcp.tools

    assert json.loads((path / "metadata.json").read_text())["sharded_backend"] == "bcp"
    report = bcp.tools.verify_checkpoint(path)
    assert report.ok, report


def assert_resumed_at_2(log: str, resumed: list[dict], straight: list[dict]) -> None:
    """The resumed run's losses are the uninterrupted run's, bit for bit; iteration 4's weights come
    from step 3, so it also proves the optimizer state."""
    assert "successfully loaded checkpoint from" in log and "at iteration 2" in log
    for rank in range(2):
        assert sorted(resumed[rank]) == [3, 4]
        for iteration in (3, 4):
            for key, loss in straight[rank][iteration].items():
                assert torch.equal(resumed[rank][iteration][key], loss), (rank, iteration, key)


@pytest.fixture(scope="module")
def straight(training_imports, tmp_path_factory):
    """pretrain_gpt.py, 4 iterations without a break; bcp checkpoints at iterations 2 and 4."""
    out = tmp_path_factory.mktemp("pretrain")
    _, losses = pretrain(out / "losses", out / "ckpt")
    assert [sorted(rank) for rank in losses] == [[1, 2, 3, 4]] * 2
    return out / "ckpt", losses


def test_pretrain_gpt_saves_bcp_and_resumes_with_the_same_losses(straight, tmp_path):
    ckpt, losses = straight
    for iteration in (2, 4):
        assert_bcp_checkpoint(ckpt / f"iter_{iteration:07d}")
    resumed = tmp_path / "ckpt"
    shutil.copytree(ckpt / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    log, after = pretrain(tmp_path / "losses", resumed)
    assert_resumed_at_2(log, after, losses)
    assert_bcp_checkpoint(resumed / "iter_0000004")


def test_pretrain_gpt_continues_a_torch_dist_run_in_bcp(straight, tmp_path):
    _, losses = straight
    ckpt = tmp_path / "ckpt"
    pretrain(tmp_path / "torch-dist-losses", ckpt, "--ckpt-format", "torch_dist", "--exit-interval", "2")
    assert json.loads((ckpt / "iter_0000002" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    log, after = pretrain(tmp_path / "losses", ckpt)
    assert_resumed_at_2(log, after, losses)
    assert_bcp_checkpoint(ckpt / "iter_0000004")
