"""Where bcp_accelerate reaches into accelerate's dataloaders beyond its public API, guarded by its version.

- ``Accelerator.prepare_data_loader`` is wrapped: a stateful loader draws its first epoch's order while
  accelerate prepares it (its ``DataLoaderAdapter`` asks the new loader for its state, which builds
  the first iterator), so a shuffled loader's sampler must be followed before that.
- On several processes accelerate's ``BatchSamplerShard`` deals whole batches of the user's batch
  sampler round-robin; the rest of a resumed epoch is dealt sample by sample (short batches where the
  share is not whole), so for that epoch the shard's ``batch_sampler`` is a :class:`ResumedBatches`
  (the epoch's batches of every process, in the shard's round-robin order) and its ``even_batches``
  is off; from the next epoch on the shard has its own back.
- Read: what the ``Accelerator`` prepared (``_models``, ``_optimizers``, ``_schedulers``,
  ``_dataloaders``), the objects registered for checkpointing (``_custom_objects``) and the state
  pre-hooks registered (``_save_model_state_pre_hook``, ``_load_model_state_pre_hook``); a moved one
  fails naming it and ``TESTED``.
- Read, not written: a ``DataLoaderShard``'s ``iteration`` (its epoch), the shard's
  ``num_processes``/``process_index``/``split_batches``, a ``SeedableRandomSampler``'s ``initial_seed``.
  ``iteration`` is written too: accelerate's own load does not restore it, and a seedable sampler
  seeds each epoch's order from it.

Applied only to the accelerate versions in ``TESTED`` whose names are as expected (``unavailable()``
says why not); ``tests/accelerate/test_accelerate_patch.py`` fails when a name moves.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from typing import Any, Callable, Iterator

import accelerate
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SeedableRandomSampler

from bcp.integration import private_name

#: accelerate versions whose names below are as bcp_accelerate reads and sets them (1.15 is tested).
TESTED = ((1, 0), (2, 0))
_MARK = "_bcp_follows_orders"
_SHARD_NAMES = ("batch_sampler", "num_processes", "process_index", "split_batches", "even_batches")
_reason: list[str] = []


def install(follow: Callable[[Any], None]) -> None:
    """Call ``follow(loader)`` on every dataloader ``Accelerator.prepare`` gets, before accelerate
    wraps it (idempotent); nothing where the installed accelerate is not one bcp_accelerate follows.
    A stateful loader given a seedable sampler starts its first epoch afresh (:func:`_seeded_from_start`)."""
    prepare = accelerate.Accelerator.prepare_data_loader
    if getattr(prepare, _MARK, False) or _reason:
        return
    reason = _why_not()
    if reason:
        _reason.append(reason)
        return

    @functools.wraps(prepare)
    def prepare_data_loader(self: accelerate.Accelerator, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        follow(data_loader)
        return _seeded_from_start(prepare(self, data_loader, *args, **kwargs))

    setattr(prepare_data_loader, _MARK, True)
    accelerate.Accelerator.prepare_data_loader = prepare_data_loader


def _seeded_from_start(loader: Any) -> Any:
    """Accelerate builds a stateful loader's first iterator (asking it for its state) before it swaps
    the seedable sampler in, and the first epoch then walks that iterator: the user's sampler's order,
    not the seeded one. The iterator is dropped, so every epoch walks its seed's order."""
    if getattr(loader, "use_stateful_dataloader", False) and callable(getattr(loader, "get_sampler", None)) \
            and isinstance(loader.get_sampler(), SeedableRandomSampler):
        loader.load_state_dict({})
    return loader


def unavailable() -> str | None:
    """Why bcp_accelerate does not follow accelerate's dataloaders (None: it does)."""
    return _reason[0] if _reason else None


def _why_not() -> str | None:
    version = tuple(int(part) for part in importlib.metadata.version("accelerate").split(".")[:2])
    if not TESTED[0] <= version < TESTED[1]:
        return (f"accelerate {'.'.join(map(str, version))} is outside the versions bcp_accelerate follows the "
                f"dataloaders of ({'.'.join(map(str, TESTED[0]))} to before {'.'.join(map(str, TESTED[1]))})")
    dealt = BatchSamplerShard([[0]], num_processes=1, process_index=0)
    missing = [name for name in _SHARD_NAMES if not hasattr(dealt, name)]
    if "iteration" not in inspect.signature(DataLoaderShard.__init__).parameters:
        missing.append("DataLoaderShard.iteration")
    if not hasattr(SeedableRandomSampler(range(1), data_seed=0), "initial_seed"):
        missing.append("SeedableRandomSampler.initial_seed")
    return f"accelerate's dataloader classes have no {', '.join(missing)}" if missing else None


def prepared(accelerator: accelerate.Accelerator, kind: str) -> list[Any]:
    """What ``accelerator`` prepared or registered, by kind: ``"models"``, ``"optimizers"``,
    ``"schedulers"``, ``"dataloaders"`` or ``"custom_objects"`` (registered for checkpointing)."""
    return private_name(accelerator, f"_{kind}", distribution="accelerate", tested=TESTED)


def state_pre_hooks(accelerator: accelerate.Accelerator, action: str) -> list[Callable[..., Any]]:
    """The hooks registered with ``register_save_state_pre_hook`` (``action="save"``) or
    ``register_load_state_pre_hook`` (``"load"``), in their order."""
    hooks = private_name(accelerator, f"_{action}_model_state_pre_hook", distribution="accelerate", tested=TESTED)
    return list(hooks.values())


def loader_epoch(loader: Any) -> int:
    """The epoch a prepared loader walks (accelerate counts the loader's iterations)."""
    return int(getattr(loader, "iteration", 0))


def set_loader_epoch(loader: Any, value: int) -> None:
    loader.iteration = value


def shard(loader: Any) -> BatchSamplerShard | None:
    """The ``BatchSamplerShard`` a prepared loader deals its batches through (None on one process)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return batch_sampler if isinstance(batch_sampler, BatchSamplerShard) else None


def user_batch_sampler(loader: Any) -> Any:
    """The batch sampler the user's loader had (inside the shard, through a resumed epoch)."""
    dealt = shard(loader)
    if dealt is None:
        return getattr(loader, "batch_sampler", None)
    inner = dealt.batch_sampler
    return inner.original if isinstance(inner, ResumedBatches) else inner


def seeded_order(sampler: Any) -> int | None:
    """The seed of an epoch's order when the sampler is accelerate's seedable one (its
    ``initial_seed`` plus the epoch), else None."""
    return int(sampler.initial_seed) if isinstance(sampler, SeedableRandomSampler) else None


def resumed_batches(loader: Any) -> "ResumedBatches | None":
    """The resumed epoch a prepared loader's shard is dealing now, or None."""
    dealt = shard(loader)
    inner = None if dealt is None else dealt.batch_sampler
    return inner if isinstance(inner, ResumedBatches) and inner.current() else None


class ResumedBatches:
    """The batches of the rest of a resumed epoch for a ``BatchSamplerShard`` (every process's, in its
    round-robin order), while the loader's epoch is ``epoch``; then the shard's own batch sampler and
    ``even_batches`` again. ``walk``/``record`` describe this process's share for a save within it."""

    def __init__(self, loader: Any, batches: list[list[int]], walk: Any, record: dict[str, Any], epoch: int) -> None:
        self.loader, self.batches, self.walk, self.record, self.epoch = loader, batches, walk, record, epoch
        dealt = shard(loader)
        self.original = user_batch_sampler(loader)
        current = dealt.batch_sampler
        self._even = current._even if isinstance(current, ResumedBatches) else dealt.even_batches
        dealt.batch_sampler, dealt.even_batches = self, False

    def current(self) -> bool:
        return shard(self.loader).batch_sampler is self and loader_epoch(self.loader) == self.epoch

    def __iter__(self) -> Iterator[list[int]]:
        if self.current():
            return iter(self.batches)
        dealt = shard(self.loader)
        dealt.batch_sampler, dealt.even_batches = self.original, self._even
        return iter(self.original)

    def __len__(self) -> int:
        return len(self.original)

    @property
    def batch_size(self) -> int:
        return self.original.batch_size

    @property
    def drop_last(self) -> bool:
        return self.original.drop_last

    @property
    def sampler(self) -> Any:
        return self.original.sampler

    @sampler.setter
    def sampler(self, sampler: Any) -> None:  # accelerate's set_sampler sets the user's batch sampler's
        self.original.sampler = sampler
