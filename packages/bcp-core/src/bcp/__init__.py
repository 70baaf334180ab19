"""bcp: distributed checkpointing with load-time resharding.

Every rank calls ``bcp.save(path, state)`` and ``bcp.load(path, state)``; a checkpoint saved in one
parallel layout loads into any other. See ``docs/format.md`` for the on-storage format.
"""

from bcp.adapters import FrameworkAdapter, register_adapter
from bcp.adapters.dataloader import DataloaderState, PartKey, ShardedDataloader, assign_parts
from bcp.adapters.distributed_sampler import ResumableDistributedSampler
from bcp.adapters.iterable_shards import ReshardableIterableDataset
from bcp.adapters.token_stream import TokenStreamLoader
from bcp.api import LoadOptions, LoadResult, PhaseStats, SaveHandle, SaveOptions, load, save, wait_pending_saves
from bcp.api.runtime import shutdown
from bcp.api.state_walk import PairedOptimizer
from bcp.chunk_codecs import Compression
from bcp.coord import Coordinator, SingleProcessCoordinator, TorchCoordinator
from bcp.errors import (
    AdapterError,
    CheckpointError,
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedError,
    FormatVersionError,
    MismatchError,
    SaveAbandonedError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from bcp.layout import Box, FlatShard, TensorShard
from bcp.storage import LocalStorage, Storage
from bcp.tier import MemoryTier
from bcp.tools.edit import remove_entries
from bcp.version import __version__

__all__ = [
    "save", "load", "wait_pending_saves", "shutdown", "remove_entries", "MemoryTier",
    "SaveOptions", "LoadOptions", "Compression", "SaveHandle", "LoadResult", "PhaseStats", "PairedOptimizer",
    "FrameworkAdapter", "register_adapter",
    "Coordinator", "SingleProcessCoordinator", "TorchCoordinator",
    "Storage", "LocalStorage",
    "Box", "TensorShard", "FlatShard",
    "CheckpointError", "CheckpointNotFoundError", "CheckpointNotCommittedError", "CorruptCheckpointError",
    "FormatVersionError", "MismatchError", "StorageError", "UnsupportedValueError", "UnsafeCheckpointError",
    "AdapterError", "DistributedError", "SaveAbandonedError",
    "__version__",
    "DataloaderState", "ShardedDataloader", "PartKey", "assign_parts", "TokenStreamLoader",
    "ResumableDistributedSampler", "ReshardableIterableDataset",
]
