"""The Trainer's checkpoints through bcp next to its own engine, on one state, side by side: how long
a save blocks the training loop (synchronous and asynchronous bcp saves) and how long a resume takes
from ``train(resume_from_checkpoint=...)`` to the first step.

    .venv/bin/python benchmarks/transformers_trainer.py                     # 2 processes, ~110 MB of weights
    .venv/bin/python benchmarks/transformers_trainer.py --processes 1 --layers 8 --reps 5

A GPT-2 built from a config (no hub) trains ``reps`` steps on CPU gloo processes with a save after
every step; the save's blocking time is the span from the step's end to the Trainer's ``on_save``
(the whole ``_save_checkpoint``: model, optimizer, scheduler, RNG, ``trainer_state.json``). The
resume's time is the span from ``train()`` to ``on_train_begin``, which the Trainer calls once it
has loaded the checkpoint into the prepared model and optimizer. Medians over the saves; a resume
per engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bcpbench.launch import launch  # noqa: E402

ENGINES = {"Trainer's own": ("transformers", {}), "bcp": ("bcp", {}), "bcp, async": (None, {"async_save": True})}


def run_engine(config: dict[str, Any]) -> dict[str, Any]:
    """On every process: ``reps`` steps with a save after each, then a resume from the last save."""
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import bcp_transformers

    variable, options = ENGINES[config["engine"]]
    os.environ.pop(bcp_transformers.ENGINE_VARIABLE, None)
    if variable is not None:
        os.environ[bcp_transformers.ENGINE_VARIABLE] = variable

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: dict[str, list[float]] = {"step_end": [], "save": [], "train_begin": []}

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.marks["step_end"].append(time.perf_counter())

        def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.marks["save"].append(time.perf_counter())

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.marks["train_begin"].append(time.perf_counter())

    tokens = torch.randint(0, config["vocab"], (1024, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]

    def trainer(max_steps: int, clock: Clock) -> Trainer:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=config["vocab"], n_positions=32, n_embd=config["width"],
                                           n_layer=config["layers"], n_head=8))
        args = TrainingArguments(output_dir=config["output"], per_device_train_batch_size=2, max_steps=max_steps,
                                 save_strategy="steps", save_steps=1, logging_steps=10_000, use_cpu=True,
                                 report_to=[], disable_tqdm=True, save_total_limit=2)
        built = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
        return bcp_transformers.enable(built, **options) if options else built

    saving = Clock()
    first = trainer(config["reps"], saving)
    parameters = sum(p.numel() for p in first.model.parameters())
    first.train()
    blocking = [save - end for end, save in zip(saving.marks["step_end"], saving.marks["save"])]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    resuming = Clock()
    started = time.perf_counter()
    trainer(config["reps"] + 1, resuming).train(resume_from_checkpoint=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return {"save_blocking_s": statistics.median(blocking), "resume_s": resuming.marks["train_begin"][0] - started,
            "parameters": parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=5, help="saves per engine (the median is shown)")
    parser.add_argument("--workdir", help="where checkpoints are written (default: a new temporary folder)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bcp-bench-trainer-", dir=args.workdir) as root:
        for engine in ENGINES:
            config = {"engine": engine, "output": os.path.join(root, engine.replace(" ", "_")), "reps": args.reps,
                      "layers": args.layers, "width": args.width, "vocab": args.vocab}
            results[engine] = launch(run_engine, args.processes, config, timeout_s=1800)
    parameters = results["bcp"]["parameters"]
    print(f"GPT-2, {parameters / 1e6:.1f} M parameters ({parameters * 12 / 2**20:.0f} MiB with AdamW's state), "
          f"{args.processes} gloo process(es), {args.reps} saves per engine (medians)\n")
    print("| engine | save blocks the loop (s) | resume to the first step (s) |")
    print("| --- | --- | --- |")
    for engine, result in results.items():
        print(f"| {engine} | {result['save_blocking_s']:.3f} | {result['resume_s']:.3f} |")


if __name__ == "__main__":
    main()
