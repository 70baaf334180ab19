"""Incremental saves, in a fresh process: a fine-tuning state of about 1 GB (the GPT-like fp32 base
of ``state.gpt_shapes``, frozen, with LoRA adapters of rank ``RANK`` on its matrices, 1% of the
parameters, and AdamW over the adapters) saved ``SAVES`` times to one path, a training step before
each save. Side by side, every save: bcp with ``incremental=True``, bcp without it, DCP, and bcp
saving the trainable part alone (the adapters and their optimizer state: what a save of trainable
parameters only writes, the floor incremental saves aim at). Then the last generation of the
incremental path and of the whole one are loaded cold, in turn, and checked bit for bit."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import bcp
import torch
from torch import nn

from bcpbench import disk
from bcpbench.record import Record, rotated, timed
from bcpbench.state import gpt_shapes

INCREMENTAL, WHOLE, DCP, TRAINABLE = "bcp incremental=True", "bcp", "DCP", "bcp, trainable part alone"
FIRST, LATER = "fine-tuning: save 1, 1 process", "fine-tuning: saves 2-5, 1 process"
LOAD = "fine-tuning: cold load of save 5, 1 process"
SAVES = 5
RANK = 14  # LoRA rank: the adapters hold about 1% of the parameters
STATE_BYTES = 1 << 30


class FineTuning(nn.Module):
    """A frozen base and, for each of its matrices in a block, a low-rank pair ``down`` (RANK x in)
    and ``up`` (out x RANK); ``trainable`` holds the adapters' parameters alone (the same objects).
    ``make(shape)`` gives each tensor's first bytes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], make: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        super().__init__()
        self.base = nn.ParameterDict({_key(n): nn.Parameter(make(s), requires_grad=False) for n, s in shapes.items()})
        self.trainable = nn.ParameterDict()
        for name, shape in shapes.items():
            if name.startswith("h.") and len(shape) == 2:
                self.trainable[_key(name) + "_down"] = nn.Parameter(make((RANK, shape[1])))
                self.trainable[_key(name) + "_up"] = nn.Parameter(make((shape[0], RANK)))


def run(config: dict[str, Any]) -> dict:
    record = Record()
    generator = torch.Generator().manual_seed(5)
    shapes = gpt_shapes(config.get("incremental_bytes", STATE_BYTES))
    model = FineTuning(shapes, lambda shape: torch.randn(shape, generator=generator))
    optimizer = torch.optim.AdamW(model.trainable.parameters(), lr=1e-3)
    root = os.path.join(config["workdir"], "incremental")
    paths = {m: os.path.join(root, m.replace(" ", "_").replace(",", "").replace("=", "-"))
             for m in (INCREMENTAL, WHOLE, DCP, TRAINABLE)}
    savers = {INCREMENTAL: lambda p: _bcp(p, {"model": model, "optimizer": optimizer}, incremental=True),
              WHOLE: lambda p: _bcp(p, {"model": model, "optimizer": optimizer}),
              DCP: lambda p: _dcp(p, model, optimizer),
              TRAINABLE: lambda p: _bcp(p, {"model": model.trainable, "optimizer": optimizer})}
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.trainable.parameters())
    record.figures["fine-tuning state"] = {"parameters": params, "trainable": trainable, "rank": RANK,
                                           "tensors": len(list(model.parameters()))}
    for save in range(SAVES):
        _step(model, optimizer, save)
        for method in rotated(list(savers), save):
            seconds, written = timed(lambda: savers[method](paths[method]))
            record.add(FIRST if save == 0 else LATER, method, seconds)
            record.append(f"fine-tuning bytes written: {method}", written)
    expected = {n: t.detach().clone() for n, t in _tensors(model, optimizer).items()}
    for rep in range(config["reps"]):
        for method in rotated([INCREMENTAL, WHOLE], rep):
            disk.evict(paths[method])  # every generation's files: the 5th refers to the 1st's
            live = FineTuning(shapes, torch.zeros)  # loaded into: other bytes, the same structure
            live_optimizer = torch.optim.AdamW(live.trainable.parameters(), lr=1e-3)
            _step(live, live_optimizer, -1)
            seconds, _ = timed(lambda: bcp.load(paths[method], {"model": live, "optimizer": live_optimizer},
                                                metrics_log=False))
            record.add(LOAD, method, seconds)
            loaded = _tensors(live, live_optimizer)
            if any(not torch.equal(loaded[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
                   for n, t in expected.items()):
                raise AssertionError(f"{method}: the 5th save does not load bit for bit")
    record.nbytes[LOAD] = sum(t.numel() * t.element_size() for t in expected.values())
    disk.remove(root)
    return record.to_dict()


def _key(name: str) -> str:
    return name.replace(".", "_")


def _step(model: FineTuning, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """A training step of the adapters (gradients drawn at random: the save sees what a real step leaves)."""
    generator = torch.Generator().manual_seed(100 + seed)
    for p in model.trainable.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-2
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _bcp(path: str, state: dict, **options: Any) -> int:
    return bcp.save(path, state, metrics_log=False, **options).stats.bytes


def _tensors(model: FineTuning, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state by name: the parameters and the optimizer state (the bytes saved)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        out.update({f"optimizer/{names[id(p)]}/{k}": v for k, v in state.items()})
    return out


def _dcp(path: str, model: FineTuning, optimizer: torch.optim.Optimizer) -> int:
    """DCP writes every tensor at each save (the same flat names and bytes as bcp's); its bytes
    written are its files' sizes."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_tensors(model, optimizer), storage_writer=dcp.FileSystemWriter(path))
    return sum(os.path.getsize(p) for p in disk.files_under(path))


def written_bytes(record: Record, method: str) -> float | None:
    """The median bytes ``method`` wrote per save after the first."""
    written = record.figures.get(f"fine-tuning bytes written: {method}", [])[1:]
    return statistics.median(written) if written else None


def report_lines(record: Record) -> list[str]:
    """The per-save table: seconds and bytes written by each method, and the cold loads of save 5."""
    state = record.figures.get("fine-tuning state")
    if not state:
        return []
    lines = [(f"A frozen GPT-like base of {state['parameters'] * 4 / 1e9:.2f} GB (fp32) with LoRA adapters of rank "
              f"{state['rank']} on its block matrices, {100 * state['trainable'] / state['parameters']:.2f}% of "
              f"the {state['parameters'] / 1e6:.0f}M parameters, AdamW over the adapters ({state['tensors']} "
              f"parameters); {SAVES} saves to one path per method, a training step before each, in a rotating "
              "order. Saves are synchronous and durable (fsync'd)."), "",
             "| method | save 1 s | saves 2-5 median s | save 1 MB written | saves 2-5 median MB written |",
             "| --- | --- | --- | --- | --- |"]
    for method in (INCREMENTAL, WHOLE, DCP, TRAINABLE):
        written = record.figures.get(f"fine-tuning bytes written: {method}", [])
        first, later = record.median(FIRST, method), record.median(LATER, method)
        if first is None or later is None or not written:
            continue
        lines.append(f"| {method} | {first:.3g} | {later:.3g} | {written[0] / 1e6:.1f} | "
                     f"{written_bytes(record, method) / 1e6:.1f} |")
    loads = record.samples.get(LOAD, {})
    if loads:
        lines += ["", (f"Cold load of save 5 ({record.nbytes.get(LOAD, 0) / 1e6:.0f} MB: every file evicted from the "
                       "page cache first; the incremental path's are the 1st generation's and the 5th's), checked "
                       "bit for bit:"), "", "| method | median s | spread s |", "| --- | --- | --- |"]
        lines += [f"| {m} | {statistics.median(v):.3g} | [{min(v):.3g}, {max(v):.3g}] |" for m, v in loads.items()]
    return lines + [""]
