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

from transformers import Trainer

from bcp import Compression, integration
from bcp_transformers import transformers_patch
from bcp_transformers.options import CheckpointOptions, set_options

#: ``bcp`` routes every trainer's checkpoints through bcp, ``transformers`` keeps the Trainer's own
#: engine even where the code opted in (a switch for operators); unset leaves the choice to the code.
#: The ``.pth`` line of ``bcp_transformers_build`` spells the same name.
ENGINE_VARIABLE = "TRANSFORMERS_CHECKPOINT_ENGINE"
ENGINES = ("bcp", "transformers")

_OPTED_IN = "_bcp_checkpoint_engine"


def requested_engine() -> str | None:
    """The engine named by ``TRANSFORMERS_CHECKPOINT_ENGINE``, or ``None`` when it is unset or empty."""
    return integration.requested_engine(ENGINE_VARIABLE, ENGINES)


def enable(trainer: Trainer, *, async_save: bool = False, save_model_files: bool = False,
           overlap: bool = False, compression: "Compression | str | bool | None" = None) -> Trainer:
    """Route this trainer's checkpoint saves and resumes through bcp; returns it. The keywords are
    :class:`CheckpointOptions`'."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"enable() takes a transformers.Trainer, got {type(trainer).__name__}")
    set_options(trainer, CheckpointOptions(async_save=async_save, save_model_files=save_model_files, overlap=overlap,
                                           compression=compression))
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
    transformers_patch.route(_dispatching)


def _dispatching(original: Callable[..., Any], through_bcp: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if uses_bcp(self):
            return through_bcp(original, self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(method, transformers_patch.ROUTED_MARK, True)
    return method
