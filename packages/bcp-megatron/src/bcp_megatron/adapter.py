"""The bcp framework adapter for Megatron's sharded values, so that ``bcp.save`` (its planning, plan
cache, staging, asynchronous commit) saves them. The strategies hand each component over as a
:class:`MegatronValues`: TensorShard lists and objects by Megatron key."""

from __future__ import annotations

from typing import Any, Mapping

from bcp import FrameworkAdapter

NAME = "megatron"


class MegatronValues(dict):
    """One component of a Megatron sharded state dict, already in bcp's value types."""


class MegatronAdapter(FrameworkAdapter):
    name = NAME
    # Megatron's DistributedOptimizer decides what a load restores (it asks for every live
    # parameter's state and never removes any): values are named by Megatron key, not by parameter.
    optimizer_state_by_parameter = False

    def detect(self, state: Mapping[str, Any]) -> bool:
        return any(isinstance(value, MegatronValues) for value in state.values())

    def model_state(self, model: Any) -> dict[str, Any]:
        return dict(model)

    def load_model_state(self, model: Any, values: dict[str, Any]) -> None:
        model.update(values)

    def optimizer_state(self, model: Any, optimizer: Any, *, for_load: bool) -> dict[str, Any]:
        return dict(optimizer)

    def load_optimizer_state(self, model: Any, optimizer: Any, values: dict[str, Any]) -> None:
        optimizer.update(values)
