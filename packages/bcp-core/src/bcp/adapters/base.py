"""The adapter interface: how a framework's model and optimizer become flat state dicts of the
core's value types (tensors, DTensors, ``TensorShard``/``FlatShard`` pieces, plain values) and how
loaded values go back. The engine fills the returned tensors in place, so on load an adapter
returns tensors that alias the live memory wherever it can.

A load that fails while applying gives every object its previous state back: before applying, the
engine asks :meth:`FrameworkAdapter.check_optimizer_state` (on every rank, before anything is
placed) and keeps :meth:`FrameworkAdapter.kept_model_state` and
:meth:`FrameworkAdapter.kept_optimizer_state` to call if the load fails. Live tensors' bytes are
restored by the engine itself."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping

from torch import nn

from bcp.adapters.optimizer import kept_optimizer_state


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

    def check_optimizer_state(self, model: Any, optimizer: Any, values: dict[str, Any]) -> None:
        """Raise a ``CheckpointError`` where :meth:`load_optimizer_state` would refuse ``values``,
        changing nothing; called on every rank before any loaded byte is placed. The default
        checks nothing."""

    def kept_model_state(self, model: Any) -> Callable[[], None]:
        """How to give ``model`` back the state it has now, once its tensors' bytes are restored. The
        default: a module's ``state_dict()`` loaded back, a dict's items put back."""
        if isinstance(model, nn.Module):
            kept = model.state_dict()
            return lambda: _loaded_back(model, kept)
        if isinstance(model, dict):
            items = dict(model)
            return lambda: (model.clear(), model.update(items))
        return lambda: None

    def kept_optimizer_state(self, model: Any, optimizer: Any) -> Callable[[], None]:
        """How to give ``optimizer`` back the state and param groups it has now, once its tensors'
        bytes are restored. The default serves a ``torch.optim.Optimizer`` and an FQN-keyed
        optimizer state dict."""
        return kept_optimizer_state(optimizer)


def _loaded_back(model: nn.Module, state: dict[str, Any]) -> None:
    model.load_state_dict(state, strict=False)
