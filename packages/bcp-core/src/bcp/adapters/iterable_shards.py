"""An iterable dataset's read-worker positions, resharded across DP sizes through a small protocol.

A ``StatefulDataLoader`` over an iterable dataset keeps, per read worker, the state its copy of the
dataset gave (``state_dict()`` in the worker, after the batches the trainer consumed from it). That
is a position within the worker's share of the stream, which only the dataset can move to another
split. A dataset that cuts its stream into a fixed set of *shards*, each read by one (DP rank,
worker) slot and each with a position of its own, can be resharded: it implements
:class:`ReshardableIterableDataset`. Its workers' states name the positions of the shards they read;
on another DP size bcp gathers every saved worker's shard positions, checks that no shard appears
twice, and hands the whole map to the live dataset before its loader starts its workers
(``load_shard_positions``), so each new (rank, worker) slot continues each shard it reads from where
it stood: every remaining sample once. On the same DP size the loader's own state is restored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch.utils.data import IterableDataset

from bcp.errors import MismatchError
from bcp.torch_internals.dataloader import state_dataset_states

if TYPE_CHECKING:  # the dataloader module builds on this one
    from bcp.adapters.part_key import PartKey

_KEY = "dataloader"
#: The key of a worker's dataset state that holds its shards' positions.
SHARDS = "shards"


@runtime_checkable
class ReshardableIterableDataset(Protocol):
    """An iterable dataset whose stream is a fixed set of shards, each with its own position.

    - ``state_dict()``, called in a read worker: ``{"shards": {shard: position}}`` for the shards this
      worker reads (shard names are strings, positions any value of bcp's safe encoding), plus
      anything else;
    - ``load_state_dict(state)``: such a state, in a worker (the loader's own restore, same DP size);
    - ``load_shard_positions(positions)``, in the trainer's process before the loader is iterated:
      the positions of every shard of the dataset; from then on each (rank, worker) slot continues
      every shard it reads from its position. Which shards a slot reads is the dataset's choice (its
      rank, ``get_worker_info()``); every shard must be read by exactly one slot.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def load_shard_positions(self, positions: dict[str, Any]) -> None: ...


def reshardable(loader: Any) -> bool:
    """Whether ``loader`` is a stateful loader over a :class:`ReshardableIterableDataset`."""
    return isinstance(getattr(loader, "dataset", None), IterableDataset) \
        and isinstance(loader.dataset, ReshardableIterableDataset) and callable(getattr(loader, "load_state_dict", None))


class IterableShards:
    """A stateful loader over a :class:`ReshardableIterableDataset` as a :class:`bcp.ShardedDataloader`:
    each DP rank's loader state is its part."""

    def __init__(self, loader: Any, dp_rank: int, dp_size: int) -> None:
        self.loader, self.dp_rank, self.dp_size = loader, dp_rank, dp_size

    def replicated_state(self) -> None:
        return None

    def sharded_states(self) -> list[Any]:
        return [self.loader.state_dict()]

    @staticmethod
    def assign_parts(saved: list[PartKey], dp_size: int) -> list[list[PartKey]]:
        """Every rank reads every saved rank's state: another DP size needs every shard's position."""
        return [list(saved) for _ in range(dp_size)]

    def load_dataloader_state(self, replicated: Any, sharded: list[Any]) -> None:
        if len(sharded) == self.dp_size:
            self.loader.load_state_dict(sharded[self.dp_rank])
            return
        positions: dict[str, Any] = {}
        for dp, state in enumerate(sharded):
            for worker, dataset_state in enumerate(state_dataset_states(state)):
                shards = dataset_state.get(SHARDS) if isinstance(dataset_state, dict) else None
                if not isinstance(shards, dict):
                    raise MismatchError(f"DP index {dp}, read worker {worker}: the dataset's state has no "
                                        f"{SHARDS!r} positions, so it cannot be resharded", key=_KEY)
                for shard, position in shards.items():
                    if shard in positions:
                        raise MismatchError(f"shard {shard!r} was read by two read workers of the saved ranks: "
                                            "every shard must be read by one", key=_KEY)
                    positions[shard] = position
        self.loader.load_state_dict({})  # a fresh iteration: the workers start from the dataset given below
        self.loader.dataset.load_shard_positions(positions)

