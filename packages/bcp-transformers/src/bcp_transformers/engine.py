"""The Trainer's checkpoint methods through bcp, each taking the Trainer's own method as ``original``.

A save keeps the Trainer's ``_save_checkpoint`` (the ``checkpoint-<step>`` folder, the best-model
bookkeeping, the callbacks' states, ``trainer_state.json``, pushing, rotation by
``save_total_limit``) and replaces what it writes in between: the model, optimizer, scheduler,
gradient scaler, every process's RNG and the position in the data become one ``bcp.save``, whose
commit comes before ``trainer_state.json`` (a synchronous save) and before any older folder is
rotated away. A resume keeps the Trainer's sequence too: it reads ``trainer_state.json``, and the
one ``bcp.load`` runs where the Trainer loads its optimizer, after ``accelerator.prepare``, so that
the model and optimizer are resharded into the layout and number of processes they have now. A
folder of the Trainer's own engine is still loaded by the Trainer's own methods.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from transformers import Trainer

import bcp
from bcp import CheckpointError, CheckpointNotCommittedError, CheckpointNotFoundError, MismatchError
from bcp_transformers import folders, positions, rng
from bcp_transformers.folders import Contents
from bcp_transformers.options import options_of

#: The bcp component recording the run: the position in the data, the number of processes that
#: saved and which components the save holds.
RECORD = "trainer"
_SAVING = "_bcp_saving"
_RESUMING = "_bcp_resuming"
_PENDING = "_bcp_pending_save"
_LOADED_RNG = "_bcp_loaded_rng"
_EPOCH = "_bcp_running_epoch"
_SCHEDULE_STEPS = "_bcp_schedule_steps"


def train(original: Callable[..., Any], trainer: Trainer, resume_from_checkpoint: "str | bool | None" = None,
          *args: Any, **kwargs: Any) -> Any:
    """``resume_from_checkpoint=True`` takes the newest folder holding a whole checkpoint (not a
    save in flight); the run's last asynchronous save has committed when ``train`` returns."""
    if resume_from_checkpoint is True:
        resume_from_checkpoint = folders.newest_resumable(trainer.args.output_dir)
    resuming = os.fspath(resume_from_checkpoint) if resume_from_checkpoint not in (None, False) else None
    setattr(trainer, _RESUMING, resuming)
    try:
        output = original(trainer, resuming, *args, **kwargs)
        finish_pending(trainer)
        return output
    finally:
        setattr(trainer, _RESUMING, None)
        setattr(trainer, _SCHEDULE_STEPS, None)


def finish_pending(trainer: Trainer) -> None:
    """Wait for the trainer's asynchronous save in flight, if any; raises if it failed."""
    handle = getattr(trainer, _PENDING, None)
    setattr(trainer, _PENDING, None)
    if handle is not None:
        handle.wait()


def run_epoch(original: Callable[..., Any], trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
    """Notes the running epoch and its batches per process, from which a save computes the position."""
    setattr(trainer, _EPOCH, (kwargs["epoch"], kwargs["steps_in_epoch"]))
    return original(trainer, *args, **kwargs)


def save_checkpoint(original: Callable[..., Any], trainer: Trainer, *args: Any, **kwargs: Any) -> None:
    finish_pending(trainer)  # one save in flight at a time
    setattr(trainer, _SAVING, True)
    try:
        original(trainer, *args, **kwargs)
    finally:
        setattr(trainer, _SAVING, False)


def save_model(original: Callable[..., Any], trainer: Trainer, output_dir: str | None = None,
               _internal_call: bool = False) -> None:
    """Inside ``_save_checkpoint``: the whole state through ``bcp.save`` (and the Trainer's model
    files too where the options ask); anywhere else the Trainer's own ``save_model``."""
    if not getattr(trainer, _SAVING, False):
        return original(trainer, output_dir, _internal_call)
    options = options_of(trainer)
    if options.save_model_files:
        original(trainer, output_dir, _internal_call)
    handle = bcp.save(output_dir, state_to_save(trainer), async_save=options.async_save, overlap=options.overlap,
                      compression=options.compression, step=trainer.state.global_step,
                      topology={"dp": trainer.args.process_index})
    setattr(trainer, _PENDING, handle)
    # save_total_limit=1 rotates the previous folder away right after this returns: it must not go
    # before this one has committed.
    if not options.async_save or trainer.args.save_total_limit == 1:
        finish_pending(trainer)


def skipped_while_saving(original: Callable[..., Any], trainer: Trainer, *args: Any, **kwargs: Any) -> None:
    """The Trainer's writers of its optimizer, scheduler, scaler and RNG files: in the bcp save already."""
    if not getattr(trainer, _SAVING, False):
        original(trainer, *args, **kwargs)


def state_to_save(trainer: Trainer) -> dict[str, Any]:
    args = trainer.args
    epoch, batches_in_epoch = getattr(trainer, _EPOCH, (0, 0))
    position = positions.at_save(epoch, trainer.state.epoch or 0.0, batches_in_epoch, args.world_size,
                                 batch_per_process(trainer))
    state: dict[str, Any] = {"model": trainer.model}
    if not args.save_only_model:
        if trainer.optimizer is not None:
            state["optimizer"] = torch_optimizer(trainer.optimizer)
        if trainer.lr_scheduler is not None:
            state["scheduler"] = trainer.lr_scheduler.state_dict()
        if getattr(trainer.accelerator, "scaler", None) is not None:
            state["scaler"] = trainer.accelerator.scaler.state_dict()
        state["rng"] = rng.capture()
    state[RECORD] = {"position": position.as_value(), "world_size": args.world_size, "components": sorted(state)}
    return state


def batch_per_process(trainer: Trainer) -> int:
    """The batch each process loads: the arguments' (with DataParallel's GPUs), or, where
    ``auto_find_batch_size`` may have lowered it, the one the Trainer's state records."""
    if trainer.args.auto_find_batch_size and trainer.state.train_batch_size:
        return trainer.state.train_batch_size
    return trainer.args.train_batch_size


def torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside accelerate's wrapper, whose parameters are the model's."""
    return getattr(optimizer, "optimizer", optimizer)


def init_training_state(original: Callable[..., Any], trainer: Trainer, max_steps: int,
                        num_update_steps_per_epoch: int, num_train_epochs: int, resume_from_checkpoint: str | None,
                        trial: Any) -> tuple[int, int]:
    """The Trainer's own, then, for a bcp checkpoint, the epoch and the batches to skip from the
    saved position in samples; an epoch-driven run ends after the epochs' remaining samples."""
    epochs, skipped = original(trainer, max_steps, num_update_steps_per_epoch, num_train_epochs,
                               resume_from_checkpoint, trial)
    if resume_from_checkpoint is None:
        return epochs, skipped
    kind = checked_contents(resume_from_checkpoint)
    args = trainer.args
    if kind is Contents.TRANSFORMERS:
        check_same_processes(resume_from_checkpoint, args.world_size, skipped)
        return epochs, skipped
    position = positions.Position.of_value(read_record(resume_from_checkpoint)["position"])
    accumulation = args.gradient_accumulation_steps
    if args.ignore_data_skip:
        skipped = 0
    else:
        skipped = positions.batches_to_skip(position, args.world_size, batch_per_process(trainer), accumulation,
                                            resume_from_checkpoint)
    if args.max_steps <= 0:
        remaining = (num_train_epochs - position.epoch) * num_update_steps_per_epoch - skipped // accumulation
        trainer.state.max_steps = trainer.state.global_step + remaining
        setattr(trainer, _SCHEDULE_STEPS, trainer.state.max_steps)
    return position.epoch, skipped


def create_scheduler(original: Callable[..., Any], trainer: Trainer, num_training_steps: int,
                     optimizer: torch.optim.Optimizer | None = None) -> Any:
    """A resumed epoch-driven run's schedule spans the steps it now takes (see ``init_training_state``)."""
    return original(trainer, getattr(trainer, _SCHEDULE_STEPS, None) or num_training_steps, optimizer)


def check_same_processes(folder: str, processes: int, skipped: int) -> None:
    """A checkpoint of the Trainer's engine records its data position as a step count, right only
    on as many processes as saved it (one RNG file each)."""
    names = os.listdir(folder)
    saved = sum(name.startswith("rng_state_") for name in names) or 1
    if saved != processes and skipped:
        raise CheckpointError(
            f"this checkpoint was written by the Trainer's own engine on {saved} processes; its position in the "
            f"data is a step count, which on {processes} processes skips other samples than those trained: resume "
            f"it on {saved} processes, or set ignore_data_skip=True to start the epoch over", path=folder)


def load_from_checkpoint(original: Callable[..., Any], trainer: Trainer, checkpoint: str,
                         model: torch.nn.Module | None = None) -> None:
    """A bcp checkpoint being resumed is loaded later, with the optimizer; any other bcp checkpoint
    loads its model here."""
    kind = checked_contents(checkpoint)
    if kind is Contents.TRANSFORMERS:
        return original(trainer, checkpoint, model)
    if getattr(trainer, _RESUMING, None) != checkpoint:
        bcp.load(checkpoint, {"model": trainer.model if model is None else model})


def load_best_model(original: Callable[..., Any], trainer: Trainer) -> None:
    best = trainer.state.best_model_checkpoint
    if checked_contents(best) is Contents.TRANSFORMERS:
        return original(trainer)
    bcp.load(best, {"model": trainer.model})


def load_optimizer_and_scheduler(original: Callable[..., Any], trainer: Trainer, checkpoint: str | None) -> None:
    """The one ``bcp.load`` of a resume: model, optimizer, scheduler, scaler and this process's RNG
    (applied later, where the Trainer applies it)."""
    if checkpoint is None or checked_contents(checkpoint) is Contents.TRANSFORMERS:
        return original(trainer, checkpoint)
    saved = set(read_record(checkpoint)["components"])
    state: dict[str, Any] = {"model": trainer.model}
    if "optimizer" in saved and trainer.optimizer is not None:
        state["optimizer"] = torch_optimizer(trainer.optimizer)
    scaler = getattr(trainer.accelerator, "scaler", None)
    wanted_values = {"scheduler": trainer.lr_scheduler is not None, "scaler": scaler is not None, "rng": True}
    state.update({name: None for name, wanted in wanted_values.items() if wanted and name in saved})
    result = bcp.load(checkpoint, state, topology={"dp": trainer.args.process_index})
    if "scheduler" in state:
        trainer.lr_scheduler.load_state_dict(state["scheduler"])
    if "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    from_rank0 = any(name == "rng" or name.startswith("rng/") for name in result.from_rank0)
    setattr(trainer, _LOADED_RNG, None if from_rank0 else state.get("rng"))


def load_scaler(original: Callable[..., Any], trainer: Trainer, checkpoint: str | None) -> None:
    if checkpoint is None or checked_contents(checkpoint) is Contents.TRANSFORMERS:
        original(trainer, checkpoint)


def load_rng_state(original: Callable[..., Any], trainer: Trainer, checkpoint: str | None) -> None:
    """This process's generators as saved (once per resume); a process beyond the number that
    saved keeps its own, as with the Trainer's engine."""
    if checkpoint is None or checked_contents(checkpoint) is Contents.TRANSFORMERS:
        return original(trainer, checkpoint)
    states = getattr(trainer, _LOADED_RNG, None)
    setattr(trainer, _LOADED_RNG, None)
    if states is not None:
        rng.restore(states)


def checked_contents(folder: str) -> Contents:
    kind = folders.contents(folder)
    if kind is Contents.NONE:
        # The Trainer's own wording first, which scripts and tests match.
        raise CheckpointNotFoundError(f"Can't find a valid checkpoint at this path: it holds {kind.value}", path=folder)
    if kind is Contents.INCOMPLETE:
        raise CheckpointNotCommittedError(f"cannot resume: the folder holds {kind.value}", path=folder)
    return kind


def read_record(folder: str) -> dict[str, Any]:
    state: dict[str, Any] = {RECORD: None}
    result = bcp.load(folder, state, strict=False, metrics_log=False)  # a step of the resume: no record of its own
    if RECORD not in result.loaded:
        raise MismatchError(f"this bcp checkpoint has no {RECORD!r} record: it was not written by a Trainer "
                            "through bcp; load it with bcp.load", path=folder)
    return state[RECORD]
