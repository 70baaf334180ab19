"""Which engine a Trainer's checkpoints use, and the switch that routes its checkpoint methods.

Every launcher (``accelerate launch``, ``torchrun``, SLURM) passes the environment on to the
processes, so the no-code-change flag is an environment variable, read at each call, never cached
at import. The explicit switch is a function over a trainer rather than a ``Trainer`` subclass:
training scripts already use subclasses of their own or a library's (TRL's ``SFTTrainer``, for
one), and ``enable`` works on any of them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import transformers
from transformers import Trainer

from bcp import AdapterError, integration
from bcp_transformers import engine
from bcp_transformers.options import CheckpointOptions, set_options

#: ``bcp`` routes every trainer's checkpoints through bcp, ``transformers`` keeps the Trainer's own
#: engine even where the code opted in (a switch for operators); unset leaves the choice to the code.
#: The ``.pth`` line of ``bcp_transformers_build`` spells the same name.
ENGINE_VARIABLE = "TRANSFORMERS_CHECKPOINT_ENGINE"
ENGINES = ("bcp", "transformers")

_OPTED_IN = "_bcp_checkpoint_engine"
_DISPATCHES = "_bcp_dispatches"
#: The Trainer's methods that the switch routes (most of them private: the Trainer has no public
#: checkpoint hooks), and what runs in their place through bcp.
_ROUTED: dict[str, Callable[..., Any]] = {
    "train": engine.train,
    "_run_epoch": engine.run_epoch,
    "_init_training_state": engine.init_training_state,
    "create_scheduler": engine.create_scheduler,
    "_save_checkpoint": engine.save_checkpoint,
    "save_model": engine.save_model,
    "_save_optimizer_and_scheduler": engine.skipped_while_saving,
    "_save_scaler": engine.skipped_while_saving,
    "_save_rng_state": engine.skipped_while_saving,
    "_load_from_checkpoint": engine.load_from_checkpoint,
    "_load_best_model": engine.load_best_model,
    "_load_optimizer_and_scheduler": engine.load_optimizer_and_scheduler,
    "_load_scaler": engine.load_scaler,
    "_load_rng_state": engine.load_rng_state,
}


def requested_engine() -> str | None:
    """The engine named by ``TRANSFORMERS_CHECKPOINT_ENGINE``, or ``None`` when it is unset or empty."""
    return integration.requested_engine(ENGINE_VARIABLE, ENGINES)


def enable(trainer: Trainer, *, async_save: bool = False, save_model_files: bool = False) -> Trainer:
    """Route this trainer's checkpoint saves and resumes through bcp; returns it. The keywords are
    :class:`CheckpointOptions`'."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"enable() takes a transformers.Trainer, got {type(trainer).__name__}")
    set_options(trainer, CheckpointOptions(async_save=async_save, save_model_files=save_model_files))
    install()
    setattr(trainer, _OPTED_IN, True)
    return trainer


def uses_bcp(trainer: Trainer) -> bool:
    """Whether this trainer's next checkpoint save or resume goes through bcp."""
    engine_name = requested_engine()
    if engine_name is not None:
        return engine_name == "bcp"
    return getattr(trainer, _OPTED_IN, False)


def install() -> None:
    """Let ``transformers.Trainer``'s checkpoint methods consult :func:`uses_bcp` on each call
    (idempotent). While it says no, the Trainer's own methods run, unchanged."""
    missing = [name for name in _ROUTED if not callable(getattr(Trainer, name, None))]
    if missing:
        raise AdapterError(f"transformers {transformers.__version__}'s Trainer has no {', '.join(missing)}: "
                           "bcp-transformers routes those checkpoint methods and was tested with transformers 5.24; "
                           f"unset {ENGINE_VARIABLE} to use the Trainer's own engine")
    for name, through_bcp in _ROUTED.items():
        original = getattr(Trainer, name)
        if not getattr(original, _DISPATCHES, False):
            setattr(Trainer, name, _dispatching(original, through_bcp))


def _dispatching(original: Callable[..., Any], through_bcp: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if uses_bcp(self):
            return through_bcp(original, self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(method, _DISPATCHES, True)
    return method
