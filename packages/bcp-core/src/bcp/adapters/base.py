"""The adapter interface: how a framework's model and optimizer become flat state dicts of the
core's value types (tensors, DTensors, ``TensorShard``/``FlatShard`` pieces, plain values) and how
loaded values go back. The engine fills the returned tensors in place, so on load an adapter
returns tensors that alias the live memory wherever it can."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping


class FrameworkAdapter(ABC):
    """One framework (or parallelism) layout. Subclasses are registered with ``register_adapter``."""

    #: The name users pass as ``framework=`` (``"plain"``, ``"ddp"``, ``"fsdp2"``, ``"megatron"``, ...).
    name: str
    #: Whether ``optimizer_state`` names values as the core does (``state/<param fqn>/<key>``,
    #: ``param_groups``): a load then restores the optimizer as ``Optimizer.load_state_dict`` does,
    #: removing the state of parameters the checkpoint holds none for.
    optimizer_state_by_parameter: bool = False

    @abstractmethod
    def detect(self, state: Mapping[str, Any]) -> bool:
        """Whether the objects in ``state`` are of this adapter's layout."""

    @abstractmethod
    def model_state(self, model: Any) -> dict[str, Any]:
        """The model's values by canonical name (wrapper prefixes removed)."""

    @abstractmethod
    def load_model_state(self, model: Any, values: dict[str, Any]) -> None:
        """Apply loaded values (tensors already filled in place, objects decoded) to the model."""

    @abstractmethod
    def optimizer_state(self, model: Any, optimizer: Any, *, for_load: bool) -> dict[str, Any]:
        """The optimizer's values by name: ``state/<param fqn>/<key>`` and ``param_groups``. With
        ``for_load``, state that does not exist yet is created first (without changing parameters)."""

    @abstractmethod
    def load_optimizer_state(self, model: Any, optimizer: Any, values: dict[str, Any]) -> None:
        """Apply loaded values (tensors already filled in place) to the optimizer."""
