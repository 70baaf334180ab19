"""The Megatron-facing part for Megatron-Core up to 0.16: bcp's ``dist_checkpointing`` strategies
and their registration (``strategies_torch_dist`` is the 0.17+ counterpart).

Megatron-Core up to 0.16 finds strategies in a registry by ``(backend, version)``;
``metadata.json`` names the backend of a saved checkpoint, so ``dist_checkpointing.load`` picks
bcp's load strategy for bcp checkpoints and torch_dist's for torch_dist ones. Everything below the
strategy methods is Megatron-version independent (``shards``, ``saving``, ``load``, ``completion``).
"""

from __future__ import annotations

import os

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

import bcp
from bcp.integration import DEFAULT_IO_THREADS, Coordinator

from bcp_megatron.adapter import MegatronAdapter
from bcp_megatron.common_state import SafeCommonLoadStrategy
from bcp_megatron.completion import completion_request
from bcp_megatron.errors import as_megatron_errors
from bcp_megatron.load import BcpLoader, read_manifest, sharded_metadata, tensors_metadata
from bcp_megatron.removal import remove_sharded
from bcp_megatron.saving import DEFAULT_KEEP_GENERATIONS, BcpSaver
from bcp_megatron.version import BACKEND, VERSION


class BcpSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects as a bcp checkpoint in ``checkpoint_dir``.

    Every replica of a tensor box is offered and the core writes each box once, balancing the bytes
    over the replicas, so no ``FullyParallelSaveStrategyWrapper`` is needed (wrapping is harmless).
    The core caches the global plan while no rank's structure changes (checked at every save).
    ``allow_pickle`` lets objects outside bcp's safe encoding be pickled (the checkpoint is then
    marked unsafe). ``coordinator`` defaults to the world. ``keep_generations``: committed
    generations of the sharded state kept when the same ``checkpoint_dir`` is saved again (each a
    full copy on disk; Megatron-LM saves every iteration to a folder of its own, where it changes
    nothing). ``incremental``: a folder saved again gets only the tensors that changed written
    (``docs/incremental.md``). ``compression``: ``"zstd"`` (or ``True``) compresses the tensors' bytes
    losslessly (``bcp.SaveOptions.compression``); loads read either kind. Megatron-Core writes ``common.pt`` and ``metadata.json`` itself, the
    newest save's only.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, allow_pickle: bool = False,
                 io_threads: int = DEFAULT_IO_THREADS, coordinator: Coordinator | None = None,
                 keep_generations: int = DEFAULT_KEEP_GENERATIONS, incremental: bool = False,
                 compression: "bcp.Compression | str | bool | None" = None) -> None:
        super().__init__(backend, version)
        self.saver = BcpSaver(bcp.SaveOptions(allow_pickle=allow_pickle, io_threads=io_threads,
                                              coordinator=coordinator, keep_generations=keep_generations,
                                              incremental=incremental, compression=compression))

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    @as_megatron_errors()
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: "str | os.PathLike") -> None:
        self.saver.save(sharded_state_dict, checkpoint_dir, async_save=False)

    @as_megatron_errors()
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: "str | os.PathLike") -> AsyncRequest:
        """Returns once this rank's tensors are staged in host memory; bcp writes and commits in
        the background and the request's finalize step waits for that commit."""
        return completion_request(self.saver.save(sharded_state_dict, checkpoint_dir, async_save=True))


class BcpLoadShardedStrategy(LoadShardedStrategy):
    """Loads a bcp checkpoint into any parallel layout. ``verify`` checks every byte read against
    its checksum; ``allow_pickle`` is needed for checkpoints saved with it; ``cast_dtype`` (on, as
    torch_dist casts) converts a tensor saved in another dtype than the requested one; ``read_once``
    reads bytes that several ranks need (data-parallel replicas) once and sends them to the others.
    No rank's tensors are written unless every rank read and verified its share."""

    def __init__(self, *, allow_pickle: bool = False, verify: bool = True, io_threads: int = DEFAULT_IO_THREADS,
                 coordinator: Coordinator | None = None, cast_dtype: bool = True, read_once: bool = False) -> None:
        super().__init__()
        self.loader = BcpLoader(bcp.LoadOptions(allow_pickle=allow_pickle, verify=verify, io_threads=io_threads,
                                                coordinator=coordinator, cast_dtype=cast_dtype, read_once=read_once))

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    @as_megatron_errors()
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: "str | os.PathLike") -> StateDict:
        return self.loader.load(sharded_state_dict, checkpoint_dir)

    @as_megatron_errors()
    def load_tensors_metadata(self, checkpoint_dir: "str | os.PathLike") -> ShardedStateDict:
        return tensors_metadata(read_manifest(checkpoint_dir))

    @as_megatron_errors()
    def load_sharded_metadata(self, checkpoint_dir: "str | os.PathLike") -> ShardedStateDict:
        return sharded_metadata(read_manifest(checkpoint_dir))

    @as_megatron_errors()
    def remove_sharded_tensors(self, checkpoint_dir: "str | os.PathLike", key_prefix: str) -> None:
        """Drop the ShardedTensors and ShardedObjects whose key starts with ``key_prefix``, their
        bytes included; called by one rank (``bcp_megatron.removal``)."""
        remove_sharded(checkpoint_dir, key_prefix)

    @as_megatron_errors()
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise bcp.FormatVersionError(
                f"this checkpoint was saved by the {loaded_backend!r} backend, which bcp's load strategy cannot "
                f"read; let dist_checkpointing.load pick the strategy from metadata.json (sharded_strategy=None)")

    @as_megatron_errors()
    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise bcp.FormatVersionError(
                f"this checkpoint was saved by version {loaded_version} of the bcp backend; this bcp-megatron "
                f"reads version {VERSION}: upgrade bcp-megatron")


def register() -> None:
    """Make ``('bcp', 1)`` a Megatron strategy: ``dist_checkpointing.save(..., sharded_strategy=('bcp', 1))``
    saves with bcp and ``dist_checkpointing.load`` picks bcp for checkpoints saved so; their
    ``common.pt`` loads with ``weights_only=True``. Idempotent."""
    bcp.register_adapter(MegatronAdapter(), priority=100)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, BcpSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, BcpLoadShardedStrategy())
    # metadata.json of every checkpoint names the 'torch' common backend (see common_state).
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, SafeCommonLoadStrategy())
