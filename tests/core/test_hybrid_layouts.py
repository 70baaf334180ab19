"""2-D hybrids: FSDP2 x TP on a 2 x 2 mesh (FSDP2 then shards DTensors that TP already
sharded, the ``_StridedShard`` placements torchtitan builds) and HSDP (replicate x shard), with AdamW,
saved and loaded bitwise into other layouts: FSDP2 on 3 ranks, TP on 2, a plain module, FSDP2 on 2."""

from __future__ import annotations

import torch
from torch import nn

import bcp
from models import MLP, assert_bitwise, build, full_state


def _hybrid(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = MLP()
    if kind == "fsdp2_tp":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(output_layouts=Replicate()),
                                               "fc2": RowwiseParallel(input_layouts=Replicate())})
        for module in (model.fc1, model.fc2, model):
            fully_shard(module, mesh=mesh["dp"])
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for module in (model.fc1, model.fc2, model):
            fully_shard(module, mesh=mesh)
    else:
        raise ValueError(kind)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, count: int) -> None:
    """The same batch on every rank: each layout computes the same model."""
    for step in range(count):
        g = torch.Generator().manual_seed(500 + step)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 7, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def save_hybrid(kind: str, path: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    model, optimizer = _hybrid(kind, seed=3)
    _steps(model, optimizer, 2)
    expected = full_state(model, optimizer)
    bcp.save(path, {"model": model, "optimizer": optimizer})
    return expected, {type(p).__name__ for param in model.parameters() for p in param.placements}


def load_into(kind: str, path: str) -> dict[str, torch.Tensor]:
    model, optimizer = _hybrid(kind, seed=11) if kind in ("fsdp2_tp", "hsdp") else build(kind, seed=11)
    bcp.load(path, {"model": model, "optimizer": optimizer})
    return full_state(model, optimizer)


def test_fsdp2_times_tp_loads_into_fsdp2_tp_and_plain_bitwise(ranks, tmp_path):
    path = str(tmp_path)
    expected, placements = ranks(4).run(save_hybrid, "fsdp2_tp", path)[0]
    assert "_StridedShard" in placements  # FSDP2 sharded what TP had sharded
    assert_bitwise(expected, ranks(4).run(load_into, "fsdp2_tp", path)[0])
    assert_bitwise(expected, ranks(3).run(load_into, "fsdp2", path)[0])
    assert_bitwise(expected, ranks(2).run(load_into, "tp", path)[0])
    assert_bitwise(expected, load_into("plain", path))


def test_hsdp_loads_into_fsdp2_bitwise(ranks, tmp_path):
    path = str(tmp_path)
    expected, placements = ranks(4).run(save_hybrid, "hsdp", path)[0]
    assert placements == {"Replicate", "Shard"}
    assert_bitwise(expected, ranks(2).run(load_into, "fsdp2", path)[0])
    assert_bitwise(expected, load_into("plain", path))
