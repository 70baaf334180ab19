"""Adapters for PyTorch's own layouts: a plain module or state dict, DDP, DTensor tensor
parallelism and FSDP2 (``fully_shard``). They differ only in what they recognise: a module's
``state_dict()`` already yields plain tensors (replicated) or DTensors (placements say the box),
which the core handles generically."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from bcp.adapters.base import FrameworkAdapter
from bcp.adapters.fqn import canonical_map
from bcp.adapters.optimizer import apply_optimizer_values, check_optimizer_values, optimizer_values
from bcp.errors import AdapterError
from bcp.layout.shards import is_dtensor


def _tensors(model: Any) -> list[Any]:
    if isinstance(model, nn.Module):
        return [*model.parameters(), *model.buffers()]
    if isinstance(model, Mapping):
        return list(model.values())
    return []


def _has_dtensor(model: Any) -> bool:
    return any(is_dtensor(t) for t in _tensors(model))


def _is_fsdp1(model: Any) -> bool:
    if not isinstance(model, nn.Module):
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _is_fsdp2(model: Any) -> bool:
    if not isinstance(model, nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _is_ddp(model: Any) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


class TorchModuleAdapter(FrameworkAdapter):
    """A module's ``state_dict()`` (or a given state dict), keyed by canonical FQN."""

    optimizer_state_by_parameter = True

    def __init__(self, name: str, matches: Callable[[Any], bool]) -> None:
        self.name = name
        self._matches = matches

    def detect(self, state: Mapping[str, Any]) -> bool:
        model = state.get("model")
        if model is not None and not isinstance(model, (nn.Module, Mapping)):
            return False
        return not _is_fsdp1(model) and self._matches(model)

    def model_state(self, model: Any) -> dict[str, Any]:
        state_dict = model if isinstance(model, Mapping) else model.state_dict()
        return {key: state_dict[original] for key, original in canonical_map(state_dict).items()}

    def load_model_state(self, model: Any, values: dict[str, Any]) -> None:
        if isinstance(model, Mapping):
            originals = canonical_map(model)
            for key, value in values.items():
                if not isinstance(value, torch.Tensor):
                    model[originals[key]] = value
            return
        originals = canonical_map(model.state_dict().keys())
        # Tensors already hold the loaded bytes (they alias the parameters); load_state_dict also
        # covers modules whose state_dict() returns copies, and non-tensor ``_extra_state``.
        result = model.load_state_dict({originals[k]: v for k, v in values.items()}, strict=False)
        if result.unexpected_keys:
            raise AdapterError(f"the module refused keys {result.unexpected_keys}")

    def optimizer_state(self, model: Any, optimizer: Any, *, for_load: bool) -> dict[str, Any]:
        return optimizer_values(model, optimizer, for_load=for_load)

    def load_optimizer_state(self, model: Any, optimizer: Any, values: dict[str, Any]) -> None:
        apply_optimizer_values(model, optimizer, values)

    def check_optimizer_state(self, model: Any, optimizer: Any, values: dict[str, Any]) -> None:
        check_optimizer_values(model, optimizer, values)


def torch_adapters() -> list[tuple[FrameworkAdapter, int]]:
    """The built-in adapters with their detection priorities (most specific first)."""
    return [
        (TorchModuleAdapter("fsdp2", _is_fsdp2), 30),
        (TorchModuleAdapter("ddp", lambda m: _is_ddp(m) and not _is_fsdp2(m)), 20),
        (TorchModuleAdapter("dtensor", lambda m: _has_dtensor(m) and not _is_fsdp2(m) and not _is_ddp(m)), 10),
        (TorchModuleAdapter("plain", lambda m: not (_is_ddp(m) or _is_fsdp2(m) or _has_dtensor(m))), 0),
    ]
