"""FSDP1 (``FullyShardedDataParallel``): each rank's flat-parameter shard is saved and loaded as
it is, with no all-gather and no extra memory (paper section 4.4).

A flat parameter concatenates a wrapped module's parameters, flattened, and cuts the result evenly
across ranks, so a rank's piece of a 2-D weight is a flat range, often not a rectangle. Each such
range becomes a ``FlatShard`` (the core stores it as a few regular boxes); FSDP's own bookkeeping
(read in ``bcp.torch_internals.fsdp1``) says which range of which parameter the local shard holds.
With ``use_orig_params=True`` the optimizer's per-parameter state is shaped like those ranges too.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from bcp.adapters.base import FrameworkAdapter
from bcp.adapters.fqn import canonical
from bcp.adapters.optimizer import STATE, apply_optimizer_values, optimizer_values
from bcp.errors import AdapterError
from bcp.layout.shards import FlatShard
from bcp.torch_internals.fsdp1 import (flat_handle, flat_parameters, persistent_buffers, shared_parameters,
                                       uses_orig_params)


def _fsdp_modules(model: Any) -> list[tuple[str, Any]]:
    if not isinstance(model, nn.Module):
        return []
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [(name, m) for name, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]


def _join(prefix: str, name: str) -> str:
    return canonical(f"{prefix}.{name}" if prefix else name)


class FSDP1Adapter(FrameworkAdapter):
    name = "fsdp"
    optimizer_state_by_parameter = True

    def detect(self, state: Mapping[str, Any]) -> bool:
        return bool(_fsdp_modules(state.get("model")))

    def flat_pieces(self, model: nn.Module) -> dict[str, FlatShard]:
        """Every parameter's local flat range, by canonical FQN (tied names included)."""
        pieces: dict[str, FlatShard] = {}
        for prefix, fsdp in _fsdp_modules(model):
            handle = flat_handle(fsdp)
            if handle is None:  # a wrapper with no parameters of its own
                continue
            flat = handle.flat_param
            if handle.uses_sharded_strategy and not handle.is_sharded(flat):
                raise AdapterError(
                    f"FSDP module {prefix or '<root>'!r} holds unsharded parameters (inside forward, "
                    "summon_full_params or before the post-backward reshard); save or load between steps")
            for fqn, shape, info in flat_parameters(flat):
                if info.in_shard:
                    local = flat.data[info.offset_in_shard: info.offset_in_shard + info.numel_in_shard]
                    start = info.intra_param_start_idx
                else:
                    local, start = flat.data[:0], 0
                pieces[_join(prefix, fqn)] = FlatShard(local, tuple(shape), start)
            for shared in shared_parameters(flat):
                primary = _join(prefix, f"{shared.prim_module_name}.{shared.prim_param_name}".lstrip("."))
                pieces[_join(prefix, f"{shared.module_name}.{shared.param_name}".lstrip("."))] = pieces[primary]
        return pieces

    def model_state(self, model: Any) -> dict[str, Any]:
        # Never model.state_dict(): under FSDP1 that all-gathers. Buffers are replicated as they are.
        values: dict[str, Any] = dict(self.flat_pieces(model))
        for module_name, module in model.named_modules():
            for name, buffer in persistent_buffers(module):
                values[_join(module_name, name)] = buffer
        for name, param in model.named_parameters():
            values.setdefault(canonical(name), param)  # parameters outside any FSDP unit (ignored modules)
        return values

    def load_model_state(self, model: Any, values: dict[str, Any]) -> None:
        """Everything was filled in place: flat shards alias the flat parameters, buffers are live."""

    def kept_model_state(self, model: Any) -> Callable[[], None]:
        """Nothing beyond the tensors' bytes, which the engine gives back (and never
        ``model.state_dict()`` here: under FSDP1 that all-gathers, on a load that may be failing)."""
        return lambda: None

    def optimizer_state(self, model: Any, optimizer: Any, *, for_load: bool) -> dict[str, Any]:
        self._check_orig_params(model)
        values = optimizer_values(model, optimizer, for_load=for_load)
        flat = self.flat_pieces(model)
        for name, value in values.items():
            if not name.startswith(STATE) or not isinstance(value, torch.Tensor) or value.dim() != 1:
                continue
            piece = flat.get(name[len(STATE):].rsplit("/", 1)[0])
            if piece is not None and value.numel() == piece.tensor.numel():
                values[name] = FlatShard(value, piece.global_shape, piece.flat_offset)
        return values

    def load_optimizer_state(self, model: Any, optimizer: Any, values: dict[str, Any]) -> None:
        apply_optimizer_values(model, optimizer, values)

    @staticmethod
    def _check_orig_params(model: nn.Module) -> None:
        for prefix, fsdp in _fsdp_modules(model):
            handle = flat_handle(fsdp)
            if handle is not None and not uses_orig_params(handle):
                raise AdapterError(
                    f"FSDP module {prefix or '<root>'!r} uses use_orig_params=False: its optimizer state "
                    "belongs to flat parameters, not to named parameters; wrap with use_orig_params=True")
