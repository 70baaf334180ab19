"""``scripts/gpu_check.sh`` (``make gpu-check``), as far as a machine without a GPU can run it: it
skips, saying so, where torch sees no CUDA device; it names the modules the interpreter lacks and
the command that fetches their wheels; and its steps (the tests, the benchmark with its bitwise
checks and ratios) run end to end on the CPU when asked to (``GPU_CHECK_DEVICE=cpu``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def check(tmp_path, **env: str) -> subprocess.CompletedProcess:
    """The script with this interpreter (and ``env``); its figures go to a folder of the test."""
    launched = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")  # as from a shell, not a job
    environment = {name: value for name, value in os.environ.items() if name not in launched}
    environment.update(PYTHON=sys.executable, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"), **env)
    return subprocess.run([SCRIPT], env=environment, capture_output=True, text=True, timeout=280)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_is_skipped_and_says_why(tmp_path):
    done = check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped, no GPU" in done.stdout and "sees no CUDA device" in done.stdout


def test_missing_modules_are_named_with_the_command_that_fetches_their_wheels(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "crc32c.py").write_text("raise ImportError('not installed here')\n")
    done = check(tmp_path, GPU_CHECK_DEVICE="cpu", PYTHONPATH=str(shadow))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "lacks: crc32c" in done.stdout
    assert "pip download --no-deps --only-binary=:all:" in done.stdout and "-d .whl crc32c" in done.stdout


def test_on_the_cpu_its_steps_run_end_to_end_with_their_checks(tmp_path):
    figures = tmp_path / "gpu.json"
    done = check(tmp_path, GPU_CHECK_DEVICE="cpu",
                 GPU_CHECK_ARGS=f"--device cpu --layers 1 --width 128 --reps 1 --no-dcp --json {figures}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu-check: tests passed; benchmark checks passed" in done.stdout
    assert "every check held (bitwise loads): met" in done.stdout and "| bcp sync save |" in done.stdout
    assert figures.exists()
