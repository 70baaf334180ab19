"""Where bcp_transformers reaches into ``transformers.Trainer`` beyond its public API, guarded by its version.

The Trainer has no public checkpoint hooks, so the switch replaces its checkpoint methods, most of
them private (``_save_checkpoint``, ``_load_from_checkpoint``, ``_save_rng_state``, ...: ``ROUTED``),
each by a method that runs the Trainer's own or the one of :mod:`bcp_transformers.engine` in its
place. Every name is read here and nowhere else, only on the transformers versions in ``TESTED``; a
moved one fails naming it and ``TESTED`` (a :class:`bcp.integration.MovedNameError`) before any
method is replaced. ``tests/transformers/test_transformers_patch.py`` fails when a name moves.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable

from transformers import Trainer

from bcp import AdapterError
from bcp.integration import private_name
from bcp_transformers import engine

#: transformers versions whose Trainer has the methods below as bcp_transformers replaces them (5.24 is tested).
TESTED = ((5, 0), (6, 0))
#: The mark of a method that dispatches between the Trainer's own and bcp's.
ROUTED_MARK = "_bcp_dispatches"
#: The Trainer's methods that the switch routes, and what runs in their place through bcp.
ROUTED: dict[str, Callable[..., Any]] = {
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


def route(dispatching: Callable[[Callable[..., Any], Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace each method of ``ROUTED`` by ``dispatching(original, through_bcp)``, marked
    ``ROUTED_MARK`` (idempotent: a marked method stays). Nothing is replaced where the installed
    transformers is outside ``TESTED`` (an :class:`AdapterError`) or a name moved."""
    reason = why_not()
    if reason:
        raise AdapterError(reason)
    originals = {name: private_name(Trainer, name, distribution="transformers", tested=TESTED) for name in ROUTED}
    for name, original in originals.items():
        if not getattr(original, ROUTED_MARK, False):
            setattr(Trainer, name, dispatching(original, ROUTED[name]))


def why_not() -> str | None:
    """Why bcp_transformers cannot route the installed transformers' Trainer; None where it can."""
    version = tuple(int(part) for part in importlib.metadata.version("transformers").split(".")[:2])
    if TESTED[0] <= version < TESTED[1]:
        return None
    return (f"transformers {'.'.join(map(str, version))} is outside the versions bcp_transformers routes the "
            f"Trainer's checkpoints of ({'.'.join(map(str, TESTED[0]))} to before {'.'.join(map(str, TESTED[1]))}); "
            "unset TRANSFORMERS_CHECKPOINT_ENGINE to use the Trainer's own engine")
