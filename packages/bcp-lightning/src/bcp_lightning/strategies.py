"""What makes a Lightning strategy checkpoint through bcp on every rank.

Lightning's DDPStrategy calls its checkpoint plugin on rank 0 only, and FSDPStrategy and
ModelParallelStrategy bypass it for torch.distributed.checkpoint. Mixed into them, ``StrategyMixin``
saves and loads on every rank with the live model and optimizers, as FQN-keyed state dicts whose
tensors alias the live ones (see ``live_state``): plain tensors under DDP, DTensors under FSDP2 and
tensor parallelism, flat-parameter shards under FSDP1. bcp writes replicated state once and
reshards on load, so a checkpoint resumes on any world size and with any of these strategies.

As with Lightning's sharded strategies, the checkpoint is restored after the strategy's setup (the
optimizers exist then) and the model and optimizers are loaded in ``load_checkpoint``: hooks such as
``on_load_checkpoint`` see Lightning's other entries, not ``state_dict``/``optimizer_states``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import bcp
from bcp_lightning import convert, lightning_patch, loader_states, targets
from bcp_lightning.io import CheckpointIOMixin
from bcp_lightning.live_state import TORCH_STATE_DICTS, LiveState


class StrategyMixin:
    """Checkpointing through bcp on every rank; mixed into a Lightning strategy class."""

    #: The BCPCheckpointIO class of the same Lightning package (set where the classes are made).
    checkpoint_io_class: type[CheckpointIOMixin]
    #: Whether index-keyed optimizer states (saved under Lightning's own DDP strategy) can be loaded:
    #: only where every rank holds whole parameters.
    loads_index_keyed_optimizer_states: bool = False
    #: How the live model and optimizers are read and given loaded state.
    live_state: LiveState = TORCH_STATE_DICTS
    #: The train loaders reach bcp through ``process_dataloader`` (no patch of the fit loop needed).
    follows_train_loaders = True

    @property
    def checkpoint_io(self) -> CheckpointIOMixin:
        if self._checkpoint_io is None:
            self._checkpoint_io = self.checkpoint_io_class()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if not isinstance(io, CheckpointIOMixin):
            raise TypeError(f"{type(self).__name__} saves through bcp and needs a BCPCheckpointIO plugin, got "
                            f"{type(io).__name__}; for asynchronous saving pass BCPCheckpointIO(async_save=True)")
        self._checkpoint_io = io

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def process_dataloader(self, dataloader: object) -> object:
        """Lightning's hook for every loader it sets up; a fit's train loaders are followed and resumed
        (``loader_states.on_train_loader``) before the loop restores their states and iterates them."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if trainer.training and trainer.state.fn == "fit":
            loader_states.on_train_loader(trainer, dataloader)
        return dataloader

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.live_state.model(self.model)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.live_state.optimizer(self.model, lightning_patch.torch_optimizer(optimizer), for_load=False)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank saves its part; the path is rank 0's.
        ``storage_options`` as for ``BCPCheckpointIO``."""
        path = self._agreed_target(filepath)
        self.checkpoint_io.save_on_ranks(checkpoint, path, storage_options=storage_options,
                                         topology=self.checkpoint_topology())

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model, and the optimizers when fitting, in place; return Lightning's other entries."""
        path = self._agreed_target(checkpoint_path)
        strict = self.lightning_module.strict_loading
        fitting = self.lightning_module.trainer.state.fn == "fit"
        optimizers = [lightning_patch.torch_optimizer(o) for o in self.optimizers] if fitting else []
        model_state = self.live_state.model(self.model)
        optimizer_states = [self.live_state.optimizer(self.model, o, for_load=True) for o in optimizers]
        checkpoint = self.checkpoint_io.load_into(path, model_state, optimizer_states, strict=strict,
                                                  topology=self.checkpoint_topology())
        self.live_state.load_model(self.model, model_state, strict=strict)
        if optimizers and convert.OPTIMIZER_STATES in checkpoint:
            self._load_index_keyed_optimizer_states(checkpoint, path)
        else:
            for optimizer, state in zip(optimizers, optimizer_states):
                self.live_state.load_optimizer(self.model, optimizer, state)
        return checkpoint

    def checkpoint_topology(self) -> dict[str, int] | None:
        """This rank's parallel coordinates for bcp's metrics records; None: data parallelism only
        (the rank in the checkpoint's group is its DP coordinate)."""
        return None

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: ``load_checkpoint`` loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: ``load_checkpoint`` loaded the optimizers."""

    def teardown(self) -> None:
        super().teardown()
        # FSDPStrategy and ModelParallelStrategy do not tear the plugin down; pending saves must finish.
        self.checkpoint_io.teardown()

    def _agreed_target(self, path: Any) -> Any:
        """Rank 0's checkpoint path, as Lightning's strategies use; a ``bcp.MemoryTier`` object is
        every rank's own (each holds its node's part of the tier)."""
        return path if targets.is_tier(path) else self.broadcast(os.fspath(path))

    def _load_index_keyed_optimizer_states(self, checkpoint: Mapping[str, Any], path: Any) -> None:
        if not self.loads_index_keyed_optimizer_states:
            raise bcp.CheckpointError(
                "the optimizer state in this checkpoint is keyed by parameter index (it was saved by "
                "BCPCheckpointIO under Lightning's own DDP or single-device strategy), so it cannot be resharded "
                f"into {type(self).__name__}; resume it with BCPDDPStrategy or Lightning's DDP, or save it with "
                "BCPDDPStrategy, whose checkpoints reshard into every strategy", path=targets.name(path))
        for optimizer, state in zip(self.optimizers, checkpoint[convert.OPTIMIZER_STATES]):
            lightning_patch.torch_optimizer(optimizer).load_state_dict(state)


#: Short names of the device mesh's dimensions (ModelParallelStrategy names them so).
_MESH_AXES = {"data_parallel": "dp", "tensor_parallel": "tp"}


def device_mesh_topology(strategy: Any) -> dict[str, int]:
    """The rank's coordinate on each dimension of the strategy's device mesh (``dp``, ``tp``)."""
    mesh = strategy.device_mesh
    return {_MESH_AXES.get(name, name): mesh.get_local_rank(name) for name in mesh.mesh_dim_names}

