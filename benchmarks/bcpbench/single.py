"""Cases in one process: save and load of the GPT-like state by every checkpointer next to the
disk's floors, async blocking time next to a bare copy, and per-tensor overhead."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from bcpbench import disk, memory, methods
from bcpbench.methods import FIRST_SAVE, Bcp, Dcp, PlanChannel, RawFiles, Safetensors, TorchSave
from bcpbench.record import Record, rotated, timed
from bcpbench.rounds import Entry, Group, Load, keep_phases, run_rounds, saving
from bcpbench.state import gpt_shapes, many_small, random_state, state_nbytes, zeros_in_one_block

SAVE, COLD, WARM = "save, 1 process", "load cold, 1 process", "load warm, 1 process"
ONE = Group()
ASYNC_BLOCK, ASYNC_TOTAL = "async save: blocking, 1 process", "async save: call to committed, 1 process"


def run(config: dict[str, Any]) -> dict:
    record = Record()
    shapes = gpt_shapes(config["size_bytes"])
    state = random_state(shapes, seed=1)
    for case in (SAVE, COLD, WARM, ASYNC_BLOCK, ASYNC_TOTAL):
        record.nbytes[case] = state_nbytes(state)
    record.figures["torch_threads_1p"] = torch.get_num_threads()
    save_and_load(record, config, state)
    async_blocking(record, config, state)
    del state
    per_tensor(record, config)
    record.figures["peak RSS of the 1-process worker, all its cases"] = memory.peak_rss_bytes()
    return record.to_dict()


def save_and_load(record: Record, config: dict, state: dict[str, torch.Tensor]) -> None:
    flat, dest = zeros_in_one_block({n: tuple(t.shape) for n, t in state.items()})
    reset = flat.zero_

    def loads(loader: Any, method: str | None = None) -> list[Load]:
        return [Load(COLD, lambda p: loader.load(p, dest), expected=state, reset=reset, method=method),
                Load(WARM, lambda p: loader.load(p, dest), cold=False, method=method)]

    def raw_loads(raw: RawFiles) -> list[Load]:
        return [Load(COLD, lambda p: raw.read(p, flat)), Load(WARM, lambda p: raw.read(p, flat), cold=False)]

    io = config["io_threads"]
    bcp, first = Bcp(io_threads=io), Bcp(FIRST_SAVE, PlanChannel.fresh, io)
    unverified = Bcp(io_threads=io, verify=False)  # shows what checksum verification costs
    in_place = Bcp(io_threads=io, transactional=False)  # shows what placing only verified bytes costs
    tuned = Dcp(config["dcp_threads"])
    entries = [Entry(m.name, saving(m, state), raw_loads(m)) for m in (RawFiles(1), RawFiles(io))]
    entries += [
        Entry(bcp.name, saving(bcp, state), loads(bcp) + loads(unverified, "bcp, load with verify=False")
              + loads(in_place, "bcp, load with transactional=False"),
              after_save=keep_phases(record, "1p", bcp, ONE)),
        Entry(first.name, saving(first, state), after_save=keep_phases(record, "1p first", first, ONE)),
        Entry("DCP", saving(Dcp(), state), loads(Dcp())),
        Entry(tuned.name, saving(tuned, state)),
        Entry(TorchSave.name, saving(TorchSave(), state), loads(TorchSave())),
        Entry(Safetensors.name, saving(Safetensors(), state), loads(Safetensors())),
        Entry("memcpy", None, [Load(WARM, lambda p: methods.copy_into(dest, state) or dest, cold=False)]),
    ]
    run_rounds(record, entries, SAVE, config["workdir"], config["reps"], ONE)
    load_stats = bcp.last_load
    if load_stats is not None:
        record.figures["bcp load phases, 1p (last warm load)"] = load_stats.seconds


def async_blocking(record: Record, config: dict, state: dict[str, torch.Tensor]) -> None:
    """Blocking time of each async save, each committed before the next starts (the disk is idle
    at every call), after one untimed call that allocates reusable buffers where there are any."""
    _, buffers = zeros_in_one_block({n: tuple(t.shape) for n, t in state.items()})
    savers = [Bcp(io_threads=config["io_threads"]), methods.DcpAsync(reuse_stager=False),
              methods.DcpAsync(reuse_stager=True), Bcp(io_threads=config["io_threads"], metrics_log=True)]
    # the last: the metrics log appended too (every save builds its metrics record either way)
    names = ["bcp async_save", savers[1].name, savers[2].name, "bcp async_save, metrics log on"]
    floor = "bare copy into reused buffers"
    for rep in range(-1, config["reps"]):
        for name in rotated([floor, *names], max(rep, 0)):
            path = os.path.join(config["workdir"], f"async-{rep + 1}")
            if name == floor:
                seconds, _ = timed(lambda: methods.copy_into(buffers, state))
                total = seconds
            else:
                saver = savers[names.index(name)]
                seconds, pending = timed(functools.partial(saver.save_async, path, state))
                waited, _ = timed(functools.partial(_finish, pending))
                total = seconds + waited
                disk.remove(path)
            if rep < 0:
                record.figures[f"first call blocking: {name}"] = seconds
            else:
                record.add(ASYNC_BLOCK, name, seconds)
                record.add(ASYNC_TOTAL, name, total)
    savers[2].close()


def per_tensor(record: Record, config: dict) -> None:
    """The same bytes as ``count`` small tensors and as one tensor: the difference, per tensor, is
    what a checkpointer spends on each tensor beyond its bytes."""
    count, floats = config["small_tensors"], config["small_floats"]
    many = many_small(count, floats, seed=2)
    one = {"t": torch.cat(list(many.values()))}
    many_dest = {n: torch.zeros_like(t) for n, t in many.items()}
    one_dest = {"t": torch.zeros_like(one["t"])}
    record.figures["per-tensor workload"] = {"tensors": count, "bytes_each": floats * 4}
    first = Bcp(FIRST_SAVE, PlanChannel.fresh, config["io_threads"])
    entries = []
    for label, state, dest in (("many", many, many_dest), ("one", one, one_dest)):
        case_load = "per-tensor: load warm"
        bcp = Bcp(coordinator=lambda label=label: PlanChannel(label), io_threads=config["io_threads"])
        entries += [
            Entry(f"bcp|{label}", saving(bcp, state),
                  [Load(case_load, lambda p, d=dest, b=bcp: b.load(p, d), cold=False)],
                  after_save=keep_phases(record, f"per-tensor {label}", bcp, ONE)),
            Entry(f"{first.name}|{label}", saving(first, state),
                  after_save=keep_phases(record, f"per-tensor {label} first", first, ONE)),
            Entry(f"DCP|{label}", saving(Dcp(), state),
                  [Load(case_load, lambda p, d=dest: Dcp().load(p, d), cold=False)]),
        ]
    inner = Record()
    run_rounds(inner, entries, "per-tensor: save", config["workdir"], config["reps"], ONE)
    for case, by_method in inner.samples.items():
        for key, values in by_method.items():
            method, label = key.split("|")
            for value in values:
                record.add(f"{case}, {label}", method, value)


def _finish(pending: Any) -> None:
    """Wait for an async save: a bcp handle or a DCP future."""
    (pending.wait if hasattr(pending, "wait") else pending.result)()
