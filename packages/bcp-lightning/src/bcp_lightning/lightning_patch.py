"""The one place bcp_lightning reaches into Lightning beyond its public API, guarded by its version.

bcp_lightning's strategies see every train loader through ``Strategy.process_dataloader``, a public
hook. ``BCPCheckpointIO`` under Lightning's own strategies has none: a checkpoint plugin is told
nothing about the loaders. So, for those, the fit loop's ``_process_dataloader`` (which prepares each
train loader after Lightning put its sampler in, before the loop restores the loader's state and
iterates it) is wrapped; everything bcp_lightning does there is ``loader_states.on_train_loader``.
The other private names bcp_lightning reads are here too: the fit loop's loaders and the loader
states it is about to restore, its count of batches done in the epoch, the sampler Lightning's
``DistributedSamplerWrapper`` wraps, the torch optimizer inside a ``LightningOptimizer`` and
``core.saving._load_state``, through which ``load_from_checkpoint`` builds a module from a
checkpoint dict (a moved one fails naming it and ``TESTED``).

Each Lightning package (``lightning``, the standalone ``pytorch_lightning``) is patched only in the
versions tested (``TESTED``) and only where the names are as expected; otherwise nothing is patched
and ``unavailable()`` says why (the plugin then refuses what needs the hook, naming it).
``tests/lightning/test_lightning_patch.py`` fails when a tested name moves.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from typing import Any, Callable

from bcp.integration import private_name

#: Lightning versions whose fit loop calls ``_process_dataloader(trainer, trainer_fn, stage, dataloader)``
#: for every train loader before it restores their states and iterates them.
TESTED = ((2, 1), (2, 7))  # from 2.1 up to, not including, 2.7
PACKAGES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}
_SIGNATURE = ["trainer", "trainer_fn", "stage", "dataloader"]
_MARK = "_bcp_follows_train_loaders"
_REASONS: dict[str, str] = {}


def install(on_train_loader: Callable[[Any, Any], None]) -> None:
    """Call ``on_train_loader(trainer, loader)`` for every train loader a fit under Lightning's own
    strategies sets up, in each Lightning package whose version and names are the tested ones
    (idempotent)."""
    for package, distribution in PACKAGES.items():
        try:
            fit_loop = importlib.import_module(f"{package}.loops.fit_loop")
        except ImportError:
            continue
        original = getattr(fit_loop, "_process_dataloader", None)
        if getattr(original, _MARK, False):
            continue
        reason = _why_not(distribution, original)
        if reason:
            _REASONS[package] = reason
            continue
        fit_loop._process_dataloader = _wrapped(original, on_train_loader, importlib.import_module(f"{package}.trainer.states"))


def unavailable(trainer: Any) -> str | None:
    """Why the train loaders of ``trainer``'s package are not followed (None: they are)."""
    return _REASONS.get(_package_of(trainer))


def _why_not(distribution: str, original: Any) -> str | None:
    try:
        version = tuple(int(part) for part in importlib.metadata.version(distribution).split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return f"the installed {distribution}'s version is unknown"
    if not TESTED[0] <= version < TESTED[1]:
        return (f"{distribution} {'.'.join(map(str, version))} is outside the versions bcp_lightning follows the fit "
                f"loop's train loaders in ({'.'.join(map(str, TESTED[0]))} to before {'.'.join(map(str, TESTED[1]))})")
    if not callable(original) or list(inspect.signature(original).parameters) != _SIGNATURE:
        return f"{distribution}'s fit loop has no _process_dataloader({', '.join(_SIGNATURE)})"
    return None


def _wrapped(original: Any, on_train_loader: Callable[[Any, Any], None], states: Any) -> Any:
    @functools.wraps(original)
    def process_dataloader(trainer: Any, trainer_fn: Any, stage: Any, dataloader: object) -> object:
        loader = original(trainer, trainer_fn, stage, dataloader)
        strategy_follows = getattr(trainer.strategy, "follows_train_loaders", False)
        if stage == states.RunningStage.TRAINING and trainer_fn == states.TrainerFn.FITTING and not strategy_follows:
            on_train_loader(trainer, loader)
        return loader

    setattr(process_dataloader, _MARK, True)
    return process_dataloader


def _package_of(trainer: Any) -> str:
    module = type(trainer).__module__
    return "pytorch_lightning" if module.startswith("pytorch_lightning") else "lightning.pytorch"


# The fit loop's private state bcp_lightning reads and moves.

def train_loaders(trainer: Any) -> list[Any] | None:
    """The train loaders the fit loop iterates (None before it set them up)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return None if combined is None else list(combined.flattened)


def states_to_restore(trainer: Any) -> Any:
    """The loader states the fit loop will give its train loaders (the list a checkpoint load put
    there), or None."""
    return getattr(trainer.fit_loop, "_combined_loader_states_to_load", None)


def move_batches_done(trainer: Any, batches: int) -> None:
    """Add ``batches`` to the fit loop's count of the epoch's batches done (it ends the epoch when
    that count reaches the loader's length)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    for name in ("ready", "started", "processed", "completed"):
        setattr(current, name, getattr(current, name) + batches)


def batches_done(trainer: Any) -> int:
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def wrapped_sampler(sampler: Any) -> Any:
    """The sampler Lightning's ``DistributedSamplerWrapper`` deals the indices of, or None."""
    return getattr(getattr(sampler, "dataset", None), "_sampler", None)


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (``optimizer`` itself
    when it is not wrapped)."""
    return getattr(optimizer, "_optimizer", optimizer)


def module_from_checkpoint(cls: type, checkpoint: dict[str, Any], **kwargs: Any) -> Any:
    """``cls`` built from a checkpoint dict as ``cls.load_from_checkpoint`` builds it (hyper-parameters,
    weights, ``on_load_checkpoint``), through ``core.saving._load_state`` of its Lightning package."""
    saving = _saving_module(cls)
    distribution = PACKAGES[saving.__name__.rpartition(".core.")[0]]
    return private_name(saving, "_load_state", distribution=distribution, tested=TESTED)(cls, checkpoint, **kwargs)


def _saving_module(cls: type) -> Any:
    """``core.saving`` of the Lightning package ``cls`` belongs to (``lightning.pytorch`` or the
    standalone ``pytorch_lightning``): where ``load_from_checkpoint`` builds a module from a
    checkpoint dict."""
    for base in cls.__mro__:
        module = base.__module__
        for package in ("lightning.pytorch", "pytorch_lightning"):
            if module.startswith(package + ".core."):
                return importlib.import_module(package + ".core.saving")
    raise TypeError(f"{cls.__name__} is not a LightningModule or LightningDataModule")
