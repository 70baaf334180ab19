"""The tensor path: the same tensors saved and loaded however the state holds them.

One process: (a) a module and its AdamW optimizer (``{"model": m, "optimizer": opt}``), (b) every
one of their tensors in a dict under one key (``{"t": tensors}``), (c) that dict as the state itself
(top-level tensors). Two gloo processes, DDP-replicated: (a) the DDP module and its AdamW, (d) the
DDP module and an EMA of its parameters held as a dict of tensors (``{"model": ddp, "ema": ema}``).
Beside them: DCP and ``torch.save`` of the same tensors (on 2 processes ``torch.save`` by rank 0,
as DDP scripts do) and, on 1 process, the disk's floor. Saves are fsync'd; loads are cold and fill
live tensors of their own storage each (as a module's, an optimizer's or an EMA's are), so every
layout may be placed the same way. ``targets`` compares (b), (c) and (d) with (a) per byte.

Each bcp layout saves on a plan-cache channel of its own, as a training job saving one structure
does (the rounds alternate the layouts). A load is checked (untimed warm-up round) against what
the live state holds after it, so the same script measures code that replaced tensors held in
dicts instead of filling them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import bcp
import torch
import torch.distributed as dist
from torch import nn

from bcpbench.methods import Dcp, PlanChannel, RawFiles, TorchSave
from bcpbench.record import Record
from bcpbench.rounds import Entry, Group, Load, keep_phases, run_rounds
from bcpbench.state import gpt_shapes, random_state

SAVE_1P, COLD_1P = "tensor path: save, 1 process", "tensor path: load cold, 1 process"
SAVE_2P = "tensor path: save, 2 processes, DDP-replicated"
COLD_2P = "tensor path: load cold, 2 processes, DDP-replicated (each process loads all)"
CASES = (SAVE_1P, COLD_1P, SAVE_2P, COLD_2P)
MODULE = "(a) module + optimizer"
DICT = '(b) {"t": dict of tensors}'
TOP = "(c) top-level tensors"
EMA = "(d) DDP module + dict EMA"
DCP = "DCP"
TORCH_SAVE_RANK0 = "torch.save by rank 0"
#: Figure keys: ``BYTES + case`` holds the bytes of state each method of the case moves per
#: process; ``WRITTEN`` the data bytes each rank wrote in the 2-process saves, by method.
BYTES = "tensor path bytes, "
WRITTEN = "tensor path: data bytes written per rank, 2 processes"
SEED = 5
ONE = Group()

Tensors = dict[str, torch.Tensor]
State = dict[str, Any]


class Params(nn.Module):
    """A module whose parameters are the given tensors (dots in names become underscores)."""

    def __init__(self, tensors: Tensors) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(tensor))


def trained(tensors: Tensors, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A module of ``tensors`` and its AdamW after one step (seeded gradients, zero for zero
    tensors, which stay zero: a destination), so the optimizer holds two moments and a step per
    parameter."""
    model = Params(tensors)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.rand(p.shape, generator=generator) if bool(p.detach().any()) else torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def tensors_of(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Tensors:
    """A module's parameters (and its optimizer's state tensors), by name: the tensors themselves."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    for name, p in model.named_parameters() if optimizer is not None else ():
        out.update({f"{name}.{key}": t for key, t in optimizer.state[p].items() if isinstance(t, torch.Tensor)})
    return out


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def zeroed(tensors: Tensors) -> Tensors:
    """Zeroed tensors of the same shapes, each of its own storage (touched now: no page faults later)."""
    return {name: torch.zeros_like(t) for name, t in tensors.items()}


class Live(Mapping[str, torch.Tensor]):
    """The tensors a live state holds, flattened on first access, after the timing."""

    def __init__(self, state: State, flatten: Callable[[State], Tensors]) -> None:
        self._state, self._flatten = state, flatten
        self._tensors: Tensors | None = None

    def _all(self) -> Tensors:
        if self._tensors is None:
            self._tensors = self._flatten(self._state)
        return self._tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class Layout:
    """One way to hold the tensors: the state saved, the live state loaded into (and how to list
    the tensors either holds), saved and loaded by bcp on a coordinator of its own."""

    def __init__(self, name: str, source: State, dest: State, flatten: Callable[[State], Tensors],
                 coordinator: Any, io_threads: int) -> None:
        self.name, self.source, self.dest, self.flatten = name, source, dest, flatten
        self.coordinator, self.io_threads = coordinator, io_threads
        self.last_save: bcp.PhaseStats | None = None
        self.load_phases: list[dict[str, float]] = []  # of every load, the warm-up round's first

    def save(self, path: str) -> None:
        self.last_save = bcp.save(path, self.source, coordinator=self.coordinator, io_threads=self.io_threads).stats

    def load(self, path: str) -> Live:
        stats = bcp.load(path, self.dest, coordinator=self.coordinator, io_threads=self.io_threads).stats
        self.load_phases.append(stats.seconds)
        return Live(self.dest, self.flatten)

    def label(self) -> str:
        """How the per-phase figures name this layout: ``tensor path 1p (b)``."""
        return f"tensor path {dist.get_world_size() if dist.is_initialized() else 1}p {self.name[:3]}"

    def keep_load_phases(self, record: Record, group: Group) -> None:
        """The timed loads' per-phase seconds (the warm-up round's load left out)."""
        if group.is_root and len(self.load_phases) > 1:
            record.figures[f"bcp load phases, {self.label()} (cold)"] = self.load_phases[1:]

    def reset(self) -> None:
        for tensor in self.flatten(self.dest).values():
            tensor.zero_()

    def entry(self, record: Record, cold: str, group: Group, count_written: bool = False) -> Entry:
        save, after_save = _remembering(record, self.name, self.save, group, count_written,
                                        keep_phases(record, self.label(), self, group))
        return Entry(self.name, save, [Load(cold, self.load, expected=self.flatten(self.source), reset=self.reset)],
                     after_save=after_save)


class Channel(bcp.TorchCoordinator):
    """A torch.distributed coordinator with a plan-cache entry of its own (its channel's), as
    ``PlanChannel`` is for one process."""

    def cache_key(self) -> object:
        return (super().cache_key(), self.channel)


def one_process(config: dict[str, Any]) -> dict:
    record = Record()
    io = config["io_threads"]
    model, optimizer = trained(random_state(module_shapes(config["tensor_path_bytes"]), SEED), SEED)
    source = tensors_of(model, optimizer)
    dest_model, dest_optimizer = trained(zeroed(tensors_of(model)), SEED)
    dest = zeroed(source)  # (b), (c) and the anchors load into these
    layouts = [
        Layout(MODULE, {"model": model, "optimizer": optimizer}, {"model": dest_model, "optimizer": dest_optimizer},
               lambda s: tensors_of(s["model"], s["optimizer"]), PlanChannel(("tensor path", MODULE)), io),
        Layout(DICT, {"t": source}, {"t": dest}, lambda s: s["t"], PlanChannel(("tensor path", DICT)), io),
        Layout(TOP, dict(source), dict(dest), dict, PlanChannel(("tensor path", TOP)), io),
    ]
    raw, flat = RawFiles(io), torch.zeros(nbytes(source) // 4 + 1)
    entries = [Entry(raw.name, lambda p: raw.save(p, source), [Load(COLD_1P, lambda p: raw.read(p, flat))])]
    entries += [layout.entry(record, COLD_1P, ONE) for layout in layouts]
    entries += _anchor_entries(record, COLD_1P, source, dest, [(DCP, Dcp()), (TorchSave.name, TorchSave())], ONE)
    for case in (SAVE_1P, COLD_1P):
        record.nbytes[case] = nbytes(source)
        record.figures[BYTES + case] = {entry.name: nbytes(source) for entry in entries}
    run_rounds(record, entries, SAVE_1P, config["workdir"], config["reps"], ONE)
    for layout in layouts:
        layout.keep_load_phases(record, ONE)
    return record.to_dict()


def two_processes(config: dict[str, Any]) -> dict:
    """Every process holds the whole state (DDP): the ideal writes each byte once, half by each
    process, and each process then loads every byte."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    record = Record()
    group = Group(dist.get_rank(), dist.barrier)
    io = config["io_threads"]
    shapes = module_shapes(config["tensor_path_bytes"])
    model, optimizer = trained(random_state(shapes, SEED), SEED)
    dest_model, dest_optimizer = trained(zeroed(tensors_of(model)), SEED)
    ema = dict(zip(tensors_of(model), random_state(shapes, SEED + 1).values()))  # by the parameters' names
    dest_ema = zeroed(ema)
    model, dest_model = DDP(model), DDP(dest_model)

    def model_and_ema(state: State) -> Tensors:
        return {**{f"model.{n}": t for n, t in tensors_of(state["model"]).items()},
                **{f"ema.{n}": t for n, t in state["ema"].items()}}

    layouts = [
        Layout(MODULE, {"model": model, "optimizer": optimizer}, {"model": dest_model, "optimizer": dest_optimizer},
               lambda s: tensors_of(s["model"], s["optimizer"]), Channel(channel="bench tensor path a"), io),
        Layout(EMA, {"model": model, "ema": ema}, {"model": dest_model, "ema": dest_ema}, model_and_ema,
               Channel(channel="bench tensor path d"), io),
    ]
    entries = [layout.entry(record, COLD_2P, group, count_written=True) for layout in layouts]
    # The anchors save what (d) holds: the module's state dict and the EMA, as one flat dict.
    source = model_and_ema(layouts[1].source)
    dest = zeroed(source)
    rank0 = _RankZero(TorchSave(), group)
    entries += _anchor_entries(record, COLD_2P, source, dest, [(DCP, Dcp()), (TORCH_SAVE_RANK0, rank0)], group,
                               count_written=True)
    sizes = {entry.name: nbytes(source) for entry in entries} | {MODULE: nbytes(layouts[0].flatten(layouts[0].source))}
    for case in (SAVE_2P, COLD_2P):
        record.nbytes[case] = sizes[MODULE]
        record.figures[BYTES + case] = sizes
    run_rounds(record, entries, SAVE_2P, config["workdir"], config["reps"], group)
    for layout in layouts:
        layout.keep_load_phases(record, group)
    return record.to_dict()


class _RankZero:
    """``torch.save`` by rank 0 alone, loaded by every process (what DDP scripts do)."""

    def __init__(self, saver: TorchSave, group: Group) -> None:
        self.saver, self.group = saver, group

    def save(self, path: str, state: Tensors) -> None:
        if self.group.is_root:
            self.saver.save(path, state)

    def load(self, path: str, dest: Tensors) -> Tensors:
        return self.saver.load(path, dest)


def _anchor_entries(record: Record, cold: str, source: Tensors, dest: Tensors, anchors: list[tuple[str, Any]],
                    group: Group, count_written: bool = False) -> list[Entry]:
    """DCP and ``torch.save`` of the same tensors as one flat dict, loaded into ``dest``."""
    def reset() -> None:
        for tensor in dest.values():
            tensor.zero_()

    entries = []
    for name, anchor in anchors:
        save, after_save = _remembering(record, name, lambda p, a=anchor: a.save(p, source), group, count_written)
        entries.append(Entry(name, save, [Load(cold, lambda p, a=anchor: a.load(p, dest), expected=source,
                                               reset=reset)], after_save=after_save))
    return entries


def _remembering(record: Record, name: str, save: Callable[[str], None], group: Group, count_written: bool,
                 then: Callable[[int], None] | None = None) -> tuple[Callable[[str], None], Callable[[int], None]]:
    """An entry's save and its ``after_save``: with ``count_written``, the first timed save's data
    bytes per rank go into ``WRITTEN`` (counted after the timing); ``then`` runs too."""
    saved: list[str] = []

    def remembered(path: str) -> None:
        save(path)
        saved[:] = [path]

    def after_save(rep: int) -> None:
        if then is not None:
            then(rep)
        if count_written and rep == 0 and group.is_root and saved:
            record.figures.setdefault(WRITTEN, {})[name] = written_per_rank(saved[0])

    return remembered, after_save


_DATA_FILE = re.compile(r"(?:data/(\d{5})-\d+\.bin|__(\d+)_\d+\.distcp|state\.pt)$")


def written_per_rank(path: str) -> dict[str, int]:
    """Data bytes under a checkpoint by the rank that wrote them: bcp's ``data/<rank>-<n>.bin``,
    DCP's ``__<rank>_<n>.distcp``, ``torch.save``'s one file (rank 0's). Metadata is left out."""
    out: dict[str, int] = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            match = _DATA_FILE.search(os.path.relpath(full, path))
            if match:
                rank = str(int(match.group(1) or match.group(2) or 0))
                out[rank] = out.get(rank, 0) + os.path.getsize(full)
    return dict(sorted(out.items()))


def module_shapes(total_bytes: int) -> dict[str, tuple[int, ...]]:
    """The module's shapes: with AdamW's two moments, about ``total_bytes`` in all."""
    return gpt_shapes(total_bytes // 3)
