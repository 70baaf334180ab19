"""A tiny GPT-2 built from a config, a Trainer over 96 numbered samples, and what a run observed.

The cases run on the shared pool's ranks, so every run leaves the process as it found it:
accelerate's global state is reset and ``TRANSFORMERS_CHECKPOINT_ENGINE`` restored on exit.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator
from unittest import mock

import torch
from accelerate import FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import bcp_transformers

SAMPLES = 96
BATCH = 4
SEQUENCE = 8
SAVED_AT = 6


class Numbered(torch.utils.data.Dataset):
    """Sample ``i`` is a fixed random token sequence that carries its number, so a run can tell
    which samples it trained on."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, 64, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "input_ids": self.tokens[index]}


class Recorder(TrainerCallback):
    """The loss of every step, the samples the collator batched, and the state the run resumed
    with (at ``on_train_begin``, after the Trainer loaded its checkpoint)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.losses: dict[int, float] = {}
        self.at_start: dict[str, Any] | None = None
        self.at_save: dict[int, dict[str, Any]] = {}
        self.trainer: Trainer | None = None

    def collate(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.seen.extend(f["index"] for f in features)
        ids = torch.stack([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": ids}

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.at_start = snapshot(self.trainer)

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.at_save[state.global_step] = snapshot(self.trainer)

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(3)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=SEQUENCE, n_embd=16, n_layer=2, n_head=2))


@contextlib.contextmanager
def engine(name: str | None) -> Iterator[None]:
    """``TRANSFORMERS_CHECKPOINT_ENGINE`` is ``name`` (None: unset) inside, as before outside."""
    with mock.patch.dict(os.environ):  # restores the environment as it was on exit
        os.environ.pop(bcp_transformers.ENGINE_VARIABLE, None)
        os.environ.update({} if name is None else {bcp_transformers.ENGINE_VARIABLE: name})
        try:
            yield
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def trainer(output_dir: str, recorder: Recorder, **arguments: Any) -> Trainer:
    defaults = {"per_device_train_batch_size": BATCH, "num_train_epochs": 1, "save_strategy": "steps",
                "save_steps": SAVED_AT, "logging_steps": 1, "seed": 0, "use_cpu": True, "report_to": [],
                "disable_tqdm": True, "dataloader_num_workers": 0, "remove_unused_columns": False}
    args = TrainingArguments(output_dir=output_dir, **{**defaults, **arguments})
    built = Trainer(model=tiny_gpt2(), args=args, train_dataset=Numbered(), eval_dataset=Numbered(),
                    data_collator=recorder.collate, callbacks=[recorder])
    recorder.trainer = built
    return built


def fit(output_dir: str, engine_name: str | None = "bcp", resume: "str | bool | None" = None,
        arguments: dict[str, Any] | None = None, enabled: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of ``Trainer.train`` with ``TrainingArguments`` overridden by ``arguments`` and, with
    ``enabled``, ``bcp_transformers.enable(trainer, **enabled)``; returns what it observed on this rank."""
    recorder = Recorder()
    with engine(engine_name):
        built = trainer(output_dir, recorder, **(arguments or {}))
        if (arguments or {}).get("fsdp"):
            on_fsdp(built)
        if enabled is not None:
            bcp_transformers.enable(built, **enabled)
        built.train(resume_from_checkpoint=resume)
        return {"seen": recorder.seen, "losses": recorder.losses, "at_start": recorder.at_start,
                "at_save": recorder.at_save, "end": snapshot(built),
                "best_step": built.state.best_global_step}


def on_fsdp(built: Trainer) -> None:
    """The trainer's accelerator set to FSDP with the plugin the Trainer configures from its
    ``fsdp`` and ``fsdp_config`` arguments (``version`` 1 or 2). Accelerate selects FSDP only on
    GPUs and other accelerators; on the CPU it falls back to DDP and drops the plugin. Setting the
    distributed type its launcher sets there, and the Trainer's plugin, lets accelerate's own FSDP
    preparation and the Trainer's FSDP code paths run on gloo. The device is the plain ``cpu``:
    accelerate's ``cpu:0`` of several CPU processes fails FSDP1's check that its ``device_id`` is
    the device it computes on (``cpu``)."""
    plugin = FullyShardedDataParallelPlugin(**built.args.fsdp_plugin_args)
    for state in (PartialState(), built.accelerator.state):  # two copies of one state
        state.distributed_type = DistributedType.FSDP
        state.device = torch.device("cpu")
    built.accelerator.state.fsdp_plugin = plugin
    built.is_fsdp_enabled = True


def snapshot(built: Trainer) -> dict[str, Any]:
    """Copies of the weights, optimizer state, scheduler state and step, comparable bitwise."""
    optimizer = getattr(built.optimizer, "optimizer", built.optimizer)
    names = {id(p): name for name, p in built.model.named_parameters()}
    return {
        "step": built.state.global_step,
        "model": {k: whole(v.detach()) for k, v in built.model.state_dict().items()},
        "optimizer": {} if optimizer is None else
        {names[id(p)]: {k: whole(v) if torch.is_tensor(v) else v for k, v in s.items()}
         for p, s in optimizer.state.items()},
        "scheduler": None if built.lr_scheduler is None else built.lr_scheduler.state_dict(),
    }


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor, gathered where it is a sharded DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["step"] == expected["step"]
    assert actual["scheduler"] == expected["scheduler"]
    assert_same_weights(actual["model"], expected["model"])
    assert actual["optimizer"].keys() == expected["optimizer"].keys()
    for name, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(actual["optimizer"][name][key]), torch.as_tensor(value)), (name, key)


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
