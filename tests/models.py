"""Small deterministic models and helpers shared by the multi-process cases."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bcp.adapters.fqn as fqn


class MLP(nn.Module):
    """Dimensions that no world size of 2, 3 or 4 divides evenly, so some shards are uneven."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 22)
        self.norm = nn.LayerNorm(22)
        self.fc2 = nn.Linear(22, 7)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.scale


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def build(kind: str, seed: int, lr: float = 1e-2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MLP()
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
    elif kind == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world(),))
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(output_layouts=Replicate()),
                                         "fc2": RowwiseParallel(input_layouts=Replicate())})
    elif kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        strategy = ShardingStrategy.SHARD_GRAD_OP if kind == "fsdp1_grad_op" else ShardingStrategy.FULL_SHARD
        # fc1 + norm share one flat parameter (several tensors, irregular cuts); fc2 is nested alone.
        options = dict(use_orig_params=True, sharding_strategy=strategy, device_id=torch.device("cpu"))
        model.fc2 = FullyShardedDataParallel(model.fc2, **options)
        model = FullyShardedDataParallel(model, **options)
    elif kind != "plain":
        raise ValueError(kind)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _is_tp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    has_dtensor = any(hasattr(p, "placements") for p in model.parameters())
    return has_dtensor and not isinstance(model, FSDPModule)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole model tensors by canonical name (FSDP1: through its full state dict, collectively)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return {f"model/{fqn.canonical(k)}": v.detach().clone() for k, v in model.state_dict().items()}
    return {f"model/{fqn.canonical(k)}": full(v).detach().clone() for k, v in model.state_dict().items()}


def fsdp1_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """FSDP1 optimizer state, whole, assembled from every rank's pieces at the flat ranges FSDP's own
    bookkeeping gives (torch's FSDP1 optim_state_dict fails on the CPU with empty local shards)."""
    out = {}
    for prefix, fsdp in model.named_modules():
        handle = getattr(fsdp, "_handle", None)
        if type(fsdp).__name__ != "FullyShardedDataParallel" or handle is None:
            continue
        flat = handle.flat_param
        for param, name, shape, info in zip(flat._params, flat._fqns, flat._shapes, flat._shard_param_infos):
            state = {k: v.detach().clone() for k, v in optimizer.state.get(param, {}).items()}
            pieces = [None] * world()
            dist.all_gather_object(pieces, (info.intra_param_start_idx, state) if info.in_shard else None)
            for start, per_key in filter(None, pieces):
                for key, value in per_key.items():
                    name_out = f"optimizer/{fqn.canonical(f'{prefix}.{name}'.lstrip('.'))}/{key}"
                    if value.dim() == 0:
                        out[name_out] = value
                        continue
                    whole = out.setdefault(name_out, torch.empty(shape, dtype=value.dtype))
                    whole.view(-1)[start: start + value.numel()] = value
    return out


def batch(step: int, data_parallel: bool, global_batch: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the global batch of ``step`` (the whole batch without data parallelism)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(global_batch, 12, generator=g), torch.randn(global_batch, 7, generator=g)
    if not data_parallel:
        return x, y
    per = global_batch // world()
    return x[rank() * per:(rank() + 1) * per], y[rank() * per:(rank() + 1) * per]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """Run ``steps``; returns the global mean loss of each step."""
    losses = []
    data_parallel = world() > 1 and not _is_tp(model)
    for step in steps:
        x, y = batch(step, data_parallel)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        if data_parallel:
            dist.all_reduce(value)
            value /= world()
        losses.append(value.item())
    return losses


def full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, whole, by canonical name (collective for DTensors and FSDP1)."""
    out = model_state(model)
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return out | fsdp1_optimizer_state(model, optimizer)
    names = {id(p): fqn.canonical(n) for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                out[f"optimizer/{names[id(p)]}/{key}"] = full(value).detach().clone()
    return out


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys(), (sorted(expected.keys() ^ actual.keys()))
    for name, value in expected.items():
        other = actual[name]
        assert value.dtype == other.dtype and value.shape == other.shape, name
        assert torch.equal(value.view(-1).view(torch.uint8) if value.dim() else value.reshape(1).view(torch.uint8),
                           other.view(-1).view(torch.uint8) if other.dim() else other.reshape(1).view(torch.uint8)), name


def read_manifest(path: Any) -> Any:
    """The committed manifest at ``path`` (newest generation), parsed by bcp."""
    from bcp.tools import open_checkpoint

    return open_checkpoint(path).manifest


def shard_files(path: Any, name: str) -> list[str]:
    """The data files holding tensor ``name``'s shards."""
    manifest = read_manifest(path)
    return [manifest.files[s.bytes.file] for s in manifest.tensors[name].shards]
