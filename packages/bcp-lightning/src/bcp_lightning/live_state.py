"""How a strategy reads its live model and optimizers as FQN-keyed state dicts whose tensors alias
the live memory, and gives loaded ones back.

- ``TORCH_STATE_DICTS``: torch's ``torch.distributed.checkpoint.state_dict``: plain tensors under
  DDP, DTensors under FSDP2 and tensor parallelism.
- ``FSDP1_SHARDS``: under FSDP1, torch's sharded state dict all-gathers each unit's parameters (and
  its optimizer state dict exchanges more); the core's FSDP1 adapter, the one ``bcp.save`` uses for
  ``framework="fsdp"``, describes each rank's flat-parameter shard as it is (``bcp.FlatShard``s)
  with no collective. bcp's planning is then the save's only exchange.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from bcp.integration import (adapter_for, flat_optimizer_values, initialize_state, nested_optimizer_state,
                             state_to_load_into)


class LiveState(Protocol):
    def model(self, model: torch.nn.Module) -> dict[str, Any]:
        """The model's state dict by FQN."""

    def optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, for_load: bool) -> dict[str, Any]:
        """The optimizer's state dict, keyed by parameter FQN; with ``for_load``, missing state is created."""

    def load_model(self, model: torch.nn.Module, state: dict[str, Any], *, strict: bool) -> None:
        """Give the model a state dict from ``model`` whose tensors were filled in place."""

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Give the optimizer a state dict from ``optimizer`` whose tensors were filled in place."""


class TorchStateDicts:
    def model(self, model: torch.nn.Module) -> dict[str, Any]:
        return get_model_state_dict(model)

    def optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, for_load: bool) -> dict[str, Any]:
        # torch's get_optimizer_state_dict creates missing state with a step at learning rate 0, but
        # on the live optimizer (a load that then fails would leave it stepped), without the closure
        # L-BFGS needs and with the dense gradients SparseAdam refuses: it reads a view whose state
        # holds bcp's instead, made without changing the optimizer.
        state = get_optimizer_state_dict(model, _with_state(optimizer, state_to_load_into(optimizer)))
        if not for_load and not any(optimizer.state.values()):  # never stepped
            # Saved as Optimizer.state_dict() gives it, with no state: the created state would be
            # saved, and a resume would be one Adam step ahead of the run that did not save.
            names = dict(zip((p for g in optimizer.param_groups for p in g["params"]),
                             (n for g in state["param_groups"] for n in g["params"])))
            return {"state": {names[p]: {} for p in optimizer.state if p in names},
                    "param_groups": state["param_groups"]}
        return state

    def load_model(self, model: torch.nn.Module, state: dict[str, Any], *, strict: bool) -> None:
        set_model_state_dict(model, state, options=StateDictOptions(strict=strict))

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        # The load succeeded: the optimizer may now get state, so that torch's set_optimizer_state_dict
        # does not step it itself (its step has no closure for L-BFGS); load_state_dict replaces it.
        initialize_state(optimizer)
        # Not strict: a parameter without saved state (L-BFGS keeps all of it on the first one) has
        # none after the load, as Optimizer.load_state_dict gives it; bcp checked the names itself.
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(strict=False))


class FSDP1Shards:
    def model(self, model: torch.nn.Module) -> dict[str, Any]:
        return _fsdp1(model).model_state(model)

    def optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, for_load: bool) -> dict[str, Any]:
        return nested_optimizer_state(_fsdp1(model).optimizer_state(model, optimizer, for_load=for_load))

    def load_model(self, model: torch.nn.Module, state: dict[str, Any], *, strict: bool) -> None:
        """Nothing to do: the flat shards alias the flat parameters, buffers are the live ones."""

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        _fsdp1(model).load_optimizer_state(model, optimizer, flat_optimizer_values(state))


TORCH_STATE_DICTS: LiveState = TorchStateDicts()
FSDP1_SHARDS: LiveState = FSDP1Shards()


def _with_state(optimizer: torch.optim.Optimizer, state: dict[torch.Tensor, dict[str, Any]]) -> torch.optim.Optimizer:
    """A view of ``optimizer`` (its param groups, settings and hooks) holding ``state`` instead of its own."""
    view = type(optimizer).__new__(type(optimizer))
    vars(view).update(vars(optimizer))
    view.state = defaultdict(dict, state)
    return view


def _fsdp1(model: torch.nn.Module) -> Any:
    return adapter_for({"model": model}, "fsdp")
