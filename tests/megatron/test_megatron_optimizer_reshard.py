"""Megatron GPT models trained with the DistributedOptimizer (Adam) and resharded with their
optimizer across parallel layouts, on 4 gloo ranks (1 for (1,1,1)):

- a dense GPT across tensor and pipeline parallel changes: (TP, PP, DP) = (2,1,2) -> (2,1,2) ->
  (1,2,2) -> (1,1,1) -> (2,1,2);
- a mixture-of-experts GPT (4 experts, top-2 router, ``SequentialMLP``) across expert-parallel
  sizes: EP 2 -> 4 -> 2 with the optimizer, then -> 1 -> 4 with the model only (DP 4
  throughout; see the test for why).

Each move saves the same state twice, with bcp and with Megatron's torch_dist, in the optimizer's
``fully_reshardable`` format (model-space tensors: the format Megatron reshards across TP, PP and
EP). The target layout loads both; the state each load leaves (model, fp32 main parameters,
exp_avg, exp_avg_sq and Adam's step, read back through Megatron's own ``sharded_state_dict``) must
be bitwise equal, and the whole tensors assembled from every target rank must equal those
assembled from every source rank. Then the target trains one step from each: the two losses are
bitwise equal, and they equal the source layout's own next loss (bitwise in the same layout,
within floating-point tolerance across layouts, whose reductions run in another order)."""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

import bcp_megatron  # noqa: F401  (registers the 'bcp' backend)
from megatron_parts import (assemble, assert_bitwise, cpu_megatron_optimizer, distributed_optimizer, gpt,
                            load_model_and_optimizer, main_pieces, parallel, save_torch_dist, scramble,
                            sharded_state)
from megatron_training import train_step

# Megatron-LM's choices for a checkpoint that reshards across TP, PP and EP (no per-optimizer prefix).
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
TRAINED_STEPS = 2  # before the first save, so that Adam's step and moments are not a fresh optimizer's


class Layout(NamedTuple):
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    experts: int | None = None
    optimizer: bool = True  # whether the move into this layout loads the optimizer too


def sharded(model, optimizer) -> dict:
    return sharded_state(model, optimizer, FULLY_RESHARDABLE)


def adam_steps(optimizer) -> list[float]:
    """The distinct values of every parameter's Adam step and every param group's step."""
    inners = [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]
    return sorted({float(s["step"]) for inner in inners for s in inner.state.values()}
                  | {float(g["step"]) for inner in inners for g in inner.param_groups})


def build(layout: Layout, seed: int) -> tuple:
    model = gpt(seed=seed, num_layers=2, tied=False, experts=layout.experts)
    ddp, optimizer = distributed_optimizer(model)
    return model, ddp, optimizer


def save_both(model, optimizer, bcp_dir: str, reference_dir: str) -> list:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded(model, optimizer), bcp_dir, sharded_strategy=("bcp", 1))
    save_torch_dist(sharded(model, optimizer), reference_dir)
    return main_pieces(sharded(model, optimizer))


def load(layout: Layout, path: str) -> tuple:
    """A fresh model and optimizer (another seed, scrambled) with the checkpoint at ``path`` loaded:
    the model, and the optimizer too where ``layout.optimizer`` says so."""
    from megatron.core import dist_checkpointing

    model, ddp, optimizer = build(layout, seed=2)
    scramble(model)
    if not layout.optimizer:
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, path)["model"])
        return model, ddp, optimizer
    load_model_and_optimizer(model, optimizer, path, FULLY_RESHARDABLE)
    return model, ddp, optimizer


def start(layout: Layout, bcp_dir: str, reference_dir: str) -> tuple[list, float]:
    """Trains in ``layout``, saves, and returns the saved pieces and the uninterrupted next loss."""
    with cpu_megatron_optimizer(), parallel(layout.tp, layout.pp, layout.ep):
        model, ddp, optimizer = build(layout, seed=1)
        for step in range(TRAINED_STEPS):
            train_step(ddp, optimizer, step)
        saved = save_both(model, optimizer, bcp_dir, reference_dir)
        return saved, train_step(ddp, optimizer, TRAINED_STEPS)


def resume(layout: Layout, step: int, source: tuple[str, str], target: tuple[str, str] | None) -> dict:
    """Loads ``source`` (bcp, torch_dist) into ``layout``, compares, trains step ``step`` from both,
    saves the bcp-resumed state to ``target`` (None: the chain's last layout, which nothing loads
    from) and returns what the test compares across ranks."""
    with cpu_megatron_optimizer(), parallel(layout.tp, layout.pp, layout.ep):
        reference_model, reference_ddp, reference_optimizer = load(layout, source[1])
        model, ddp, optimizer = load(layout, source[0])
        loaded = main_pieces(sharded(model, optimizer) if layout.optimizer else model.sharded_state_dict())
        reference = main_pieces(sharded(reference_model, reference_optimizer) if layout.optimizer
                                else reference_model.sharded_state_dict())
        assert_bitwise(_by_box(reference), _by_box(loaded))
        if layout.optimizer:
            steps = adam_steps(optimizer)
            assert steps == adam_steps(reference_optimizer) == [float(step)], (steps, step)
        loss, reference_loss = train_step(ddp, optimizer, step), train_step(reference_ddp, reference_optimizer, step)
        result = {"loaded": loaded, "loss": loss, "reference_loss": reference_loss}
        if target is not None:
            result.update(saved=save_both(model, optimizer, *target), next_loss=train_step(ddp, optimizer, step + 1))
        return result


def _by_box(pieces: list) -> dict[str, torch.Tensor]:
    """One rank's pieces by key and offsets (a rank holds several experts of one stacked tensor)."""
    boxes = {f"{key}@{offsets}": data for key, _, offsets, data in pieces}
    assert len(boxes) == len(pieces), "a box twice on one rank"
    return boxes


def run_chain(ranks, tmp_path, chain: list[Layout]) -> dict[str, torch.Tensor]:
    """Saves in ``chain[0]``, then moves through the rest; returns the first save's whole tensors."""
    # the last layout saves nothing: no move loads from it
    dirs = [(str(tmp_path / f"bcp{i}"), str(tmp_path / f"torch_dist{i}")) for i in range(len(chain) - 1)] + [None]
    for path in (path for pair in dirs[:-1] for path in pair):
        os.makedirs(path)  # dist_checkpointing.save expects the directory (Megatron-LM creates it)
    per_rank = ranks(chain[0].world).run(start, chain[0], *dirs[0])
    first = saved = assemble([pieces for pieces, _ in per_rank])
    next_loss = per_rank[0][1]
    for i, (previous, layout) in enumerate(zip(chain, chain[1:]), start=1):
        results = ranks(layout.world).run(resume, layout, TRAINED_STEPS + i - 1, dirs[i - 1], dirs[i])
        if not layout.optimizer:
            saved = {key: value for key, value in saved.items() if not key.startswith("optimizer.")}
        assert_bitwise(saved, assemble([r["loaded"] for r in results]))
        losses = {(r["loss"], r["reference_loss"]) for r in results}
        assert len(losses) == 1, losses
        [(loss, reference_loss)] = losses
        assert loss == reference_loss, (layout, loss, reference_loss)
        if layout == previous:
            assert loss == next_loss, (layout, loss, next_loss)
        else:
            assert math.isclose(loss, next_loss, rel_tol=1e-5), (previous, layout, loss, next_loss)
        if dirs[i] is not None:
            saved, next_loss = assemble([r["saved"] for r in results]), results[0]["next_loss"]
    return first


def test_distributed_optimizer_reshards_across_tp_and_pp(ranks, tmp_path):
    chain = [Layout(4, tp=2), Layout(4, tp=2), Layout(4, pp=2), Layout(1), Layout(4, tp=2)]
    saved = run_chain(ranks, tmp_path, chain)
    assert any(key.startswith("optimizer.state.exp_avg_sq.decoder.layers.") for key in saved)


def test_moe_reshards_across_expert_parallel_sizes(ranks, tmp_path):
    # EP 1 has one DistributedOptimizer, EP > 1 two (dense and expert parameters, chained), whose
    # param groups Megatron's own load cannot map onto each other: into EP 1 and out of it, the model
    # moves (and trains one step) with a fresh optimizer.
    # (The same-layout move is the dense test's: here each move changes the EP size.)
    chain = [Layout(4, ep=2, experts=4), Layout(4, ep=4, experts=4),
             Layout(4, ep=2, experts=4), Layout(4, ep=1, experts=4, optimizer=False),
             Layout(4, ep=4, experts=4, optimizer=False)]
    saved = run_chain(ranks, tmp_path, chain)
    experts = [key for key in saved if key.startswith("optimizer.state.exp_avg.") and ".experts." in key]
    assert experts and all(saved[key].shape[:2] == (2, 4) for key in experts), experts  # (layer, expert)
    assert any(".mlp.router.weight" in key for key in saved)
