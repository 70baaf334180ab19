"""The example's documented launch lines, run as written: 2 processes through ``torchrun`` with
``ACCELERATE_CHECKPOINT_ENGINE=bcp``, then the same run resumed on 1 process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bcp_accelerate.folders import Contents, contents

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate" / "train.py"
LAUNCH_TIMEOUT_S = 240


def launch(processes: int, project_dir: Path, steps: int) -> str:
    env = {**os.environ, "ACCELERATE_CHECKPOINT_ENGINE": "bcp", "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(EXAMPLE), "--project-dir", str(project_dir), "--steps", str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_example_saves_on_two_processes_and_resumes_on_one(tmp_path):
    project = tmp_path / "run"
    first = launch(2, project, steps=4)
    assert "saved" in first and "resumed" not in first
    second = launch(1, project, steps=8)
    assert "resumed at step 4 on 1 process(es)" in second
    root = project / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]  # total_limit=2, numbering continued
    assert all(contents(str(root / name)) is Contents.COMMITTED for name in os.listdir(root))
