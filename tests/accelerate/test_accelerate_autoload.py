"""``ACCELERATE_CHECKPOINT_ENGINE=bcp`` with no change to the user's code, for a normal and an
editable install.

bcp-accelerate is built by its own PEP 517 backend (the hooks pip calls: ``build_wheel``,
``build_editable``) and installed with pip into a fresh virtual environment; torch, accelerate and
bcp-core come from the test's environment through a path-only ``.pth``. User scripts then run in that
environment and never import bcp: ``save_state`` must write a bcp checkpoint and ``load_state`` must
restore from it. With the variable unset nothing of bcp is imported; with it set, nothing heavy is
imported until accelerate is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import bcp
import bcp.tools
from bcp_accelerate.folders import Contents, contents

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packages" / "bcp-accelerate"
RUN_TIMEOUT_S = 180

USER_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from accelerate import Accelerator

    action, folder = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0 if action == "save" else 1)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    if action == "save":
        accelerator.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        accelerator.save_state(folder)
    else:
        accelerator.load_state(folder)
    print(json.dumps({"weight": model.weight.tolist(), "bcp_accelerate": "bcp_accelerate" in sys.modules}))
""")

IMPORTED = textwrap.dedent("""
    import json, sys
    if sys.argv[1] == "accelerate":
        import accelerate
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("bcp", "bcp_accelerate",
          "bcp_accelerate_autoload", "torch", "accelerate"))))
""")


def _build(kind: str, workdir: Path) -> Path:
    """The wheel pip would build (``build_wheel`` or ``build_editable``), from a copy of the package."""
    source = workdir / "bcp-accelerate"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    hook = "build_editable" if kind == "editable" else "build_wheel"
    out = workdir / "dist"
    call = f"import sys; sys.path.insert(0, 'build_backend'); import bcp_accelerate_build as b; print(b.{hook}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", call], cwd=source, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module", params=["wheel", "editable"])
def venv(request, tmp_path_factory) -> Path:
    """A fresh virtual environment with bcp-accelerate installed by pip as ``request.param``."""
    workdir = tmp_path_factory.mktemp(request.param)
    wheel = _build(request.param, workdir)
    env_dir = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=RUN_TIMEOUT_S)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "bcp_accelerate_autoload.pth").is_file()
    # torch, accelerate and bcp-core from this environment: path lines only, nothing runs. Python reads
    # the .pth files in name order, and these paths must be there before the autoload line runs
    # (bcp-core's import hook), as an installed bcp-core is.
    (site / "aa_test_dependencies.pth").write_text(
        f"{sysconfig.get_paths()['purelib']}\n{ROOT / 'packages' / 'bcp-core' / 'src'}\n")
    return python


def _run(python: Path, script: str, *args: str, engine: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ACCELERATE_CHECKPOINT_ENGINE")}
    env["OMP_NUM_THREADS"] = "1"
    if engine is not None:
        env["ACCELERATE_CHECKPOINT_ENGINE"] = engine
    done = subprocess.run([str(python), "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_variable_alone_saves_and_loads_through_bcp(venv, tmp_path):
    folder = tmp_path / "ckpt"
    saved = json.loads(_run(venv, USER_SCRIPT, "save", str(folder), engine="bcp"))
    assert saved["bcp_accelerate"]  # imported by the hook, not by the script
    assert contents(str(folder)) is Contents.COMMITTED and bcp.tools.verify_checkpoint(str(folder)).ok
    assert not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(folder))  # no accelerate model files
    loaded = json.loads(_run(venv, USER_SCRIPT, "load", str(folder), engine="bcp"))
    assert loaded["weight"] == saved["weight"]


def test_unset_variable_imports_nothing_and_leaves_accelerate_alone(venv, tmp_path):
    assert json.loads(_run(venv, IMPORTED, "nothing", engine=None)) == []
    assert json.loads(_run(venv, IMPORTED, "nothing", engine="bcp")) == ["bcp_accelerate_autoload"]
    unset = json.loads(_run(venv, IMPORTED, "accelerate", engine=None))
    assert "accelerate" in unset and not any(m.startswith("bcp") for m in unset)
    folder = tmp_path / "ckpt"
    assert not json.loads(_run(venv, USER_SCRIPT, "save", str(folder), engine=None))["bcp_accelerate"]
    assert contents(str(folder)) is Contents.ACCELERATE
