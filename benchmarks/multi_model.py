"""A multi-model training state (student and teacher models, FSDP2, one AdamW each, and an FSDP2 EMA
of the student) saved and loaded by DCP and by bcp in one run, on 2 gloo processes.

DCP saves the FQN-keyed state dicts of ``torch.distributed.checkpoint.state_dict``; bcp saves the
live objects under the same keys. Each loads into fresh objects, and every tensor is compared with
the saved ones. Printed: bytes written and seconds (save, load, the slowest rank), each the median of
``--rounds`` rounds.

    python benchmarks/multi_model.py [--width 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bcpbench.launch import launch  # noqa: E402


def _models(width: int, seed: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    def net() -> nn.Module:
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        for layer in model:
            fully_shard(layer)
        return fully_shard(model)

    torch.manual_seed(seed)
    student, teacher, ema = net(), net(), net()
    return {"student": student, "teacher": teacher, "ema": ema,
            "opt_student": torch.optim.AdamW(student.parameters(), lr=1e-3),
            "opt_teacher": torch.optim.AdamW(teacher.parameters(), lr=1e-3)}


def _step(live: dict[str, Any]) -> None:
    import torch

    for name in ("student", "teacher"):
        model, optimizer = live[name], live[f"opt_{name}"]
        model(torch.ones(2, model[0].in_features)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        for e, s in zip(live["ema"].parameters(), live["student"].parameters()):
            e.lerp_(s, 0.1)


def _dcp_state(live: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {name: get_model_state_dict(live[name]) for name in ("student", "teacher", "ema")}
    for name in ("student", "teacher"):
        state[f"opt_{name}"] = get_optimizer_state_dict(live[name], live[f"opt_{name}"])
    return state


def _dcp_apply(live: dict[str, Any], state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for name in ("student", "teacher", "ema"):
        set_model_state_dict(live[name], state[name])
    for name in ("student", "teacher"):
        set_optimizer_state_dict(live[name], live[f"opt_{name}"], state[f"opt_{name}"])


def _tensors(live: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state, whole (collective)."""
    out = {}
    for key, value in _dcp_state(live).items():
        flat = value if "opt" not in key else {f"{p}/{k}": v for p, s in value["state"].items() for k, v in s.items()}
        for name, tensor in flat.items():
            out[f"{key}/{name}"] = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _bytes(folder: str) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def run_rank(config: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import bcp

    live = _models(config["width"], seed=1)
    _step(live)
    expected = _tensors(live)
    rank = dist.get_rank()
    figures: dict[str, list[float]] = {"dcp save": [], "dcp load": [], "bcp save": [], "bcp load": []}
    written = {}
    for round_ in range(config["rounds"]):
        for method in ("dcp", "bcp"):
            folder = os.path.join(config["root"], f"{method}-{round_}")
            dist.barrier()
            start = time.perf_counter()
            if method == "dcp":
                dcp.save(_dcp_state(live), checkpoint_id=folder)
            else:
                bcp.save(folder, live)
            dist.barrier()
            figures[f"{method} save"].append(time.perf_counter() - start)
            written[method] = _bytes(folder)
            fresh = _models(config["width"], seed=2)
            _step(fresh)  # the optimizers hold state to load into
            dist.barrier()
            start = time.perf_counter()
            if method == "dcp":
                state = _dcp_state(fresh)
                dcp.load(state, checkpoint_id=folder)
                _dcp_apply(fresh, state)
            else:
                bcp.load(folder, fresh)
            dist.barrier()
            figures[f"{method} load"].append(time.perf_counter() - start)
            assert _same(expected, _tensors(fresh)), f"{method} did not restore the state bitwise"
            if rank == 0:
                shutil.rmtree(folder)
    state_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    return {"medians": {k: statistics.median(v) for k, v in figures.items()}, "written": written,
            "state_bytes": state_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bcp-bench-multi-", dir=os.environ.get("BCP_BENCH_DIR"))
    import multi_model  # spawned workers import the function by its module name, which __main__ is not

    try:
        result = launch(multi_model.run_rank, 2, {"width": args.width, "rounds": args.rounds, "root": root}, timeout_s=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state: {result['state_bytes'] / 2**20:.1f} MiB of tensors (2 models, EMA, 2 AdamW), 2 processes")
    print("| method | bytes written | save s | load s |")
    print("| --- | --- | --- | --- |")
    for method in ("dcp", "bcp"):
        m = result["medians"]
        print(f"| {method} | {result['written'][method] / 2**20:.1f} MiB | {m[f'{method} save']:.3f} | "
              f"{m[f'{method} load']:.3f} |")


if __name__ == "__main__":
    main()
