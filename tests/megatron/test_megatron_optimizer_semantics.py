"""Megatron's DistributedOptimizer restored by a bcp load exactly as Megatron's own torch_dist
backend restores it, for a checkpoint that holds optimizer state for fewer parameters than the
live optimizer (a parameter frozen at save time), on 2 gloo ranks with real Megatron-Core objects.

Megatron decides the optimizer's semantics above the backend (``DistributedOptimizer.sharded_state_dict``
asks for every live parameter's state, ``load_state_dict`` writes what was read): unlike
``torch.optim.Optimizer.load_state_dict`` it never removes state. So:

- the same layout (the parameter still frozen) loads the same model, fp32 main parameters,
  ``exp_avg``, ``exp_avg_sq`` and steps from bcp as from torch_dist, bitwise, and the next training
  step's loss is the same;
- with the parameter unfrozen, the live optimizer asks for state the checkpoint lacks: torch_dist
  refuses the load (torch's ``CheckpointException``), and so does bcp, with a ``MismatchError`` (a Megatron ``CheckpointingException``)
  naming exactly the missing keys, before any model tensor is written.

A DistributedOptimizer that never stepped cannot be saved by Megatron at all without Apex or
Transformer Engine (``DistributedOptimizer.state_dict`` asserts one Adam step, distrib_optimizer.py:641
in 0.16.1), whichever backend is named: there is no "empty optimizer" Megatron checkpoint to load."""

from __future__ import annotations

import os

import torch

import bcp_megatron  # noqa: F401  (registers the 'bcp' backend)
from bcp.integration import open_checkpoint
from megatron_parts import (cpu_megatron_optimizer, distributed_optimizer, gpt, load_model_and_optimizer,
                            main_pieces, parallel, raised, save_torch_dist, scramble, sharded_state)
from megatron_training import train_step

FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
FROZEN = "decoder.final_layernorm.weight"


def build(seed: int, frozen: bool) -> tuple:
    model = gpt(seed=seed, num_layers=2, tied=False)
    if frozen:
        dict(model.named_parameters())[FROZEN].requires_grad_(False)
    ddp, optimizer = distributed_optimizer(model)
    return model, ddp, optimizer


def save_frozen(bcp_dir: str, reference_dir: str) -> float:
    from megatron.core import dist_checkpointing

    with cpu_megatron_optimizer(), parallel():
        model, ddp, optimizer = build(seed=1, frozen=True)
        train_step(ddp, optimizer, 0)
        dist_checkpointing.save(sharded_state(model, optimizer, FULLY_RESHARDABLE), bcp_dir, sharded_strategy=("bcp", 1))
        save_torch_dist(sharded_state(model, optimizer, FULLY_RESHARDABLE), reference_dir)
        return train_step(ddp, optimizer, 1)


def load_frozen(bcp_dir: str, reference_dir: str) -> dict:
    """Both checkpoints loaded into the layout they were saved from: what each load left, and the next loss."""
    outcome = {}
    for name, path in (("bcp", bcp_dir), ("torch_dist", reference_dir)):
        with cpu_megatron_optimizer(), parallel():
            model, ddp, optimizer = build(seed=2, frozen=True)
            scramble(model)
            load_model_and_optimizer(model, optimizer, path, FULLY_RESHARDABLE)
            pieces = main_pieces(sharded_state(model, optimizer, FULLY_RESHARDABLE))
            outcome[name] = ({f"{key}@{offsets}": data for key, _, offsets, data in pieces},
                             train_step(ddp, optimizer, 1))
    return outcome


def load_unfrozen(bcp_dir: str, reference_dir: str) -> dict:
    """Both checkpoints loaded into a model whose frozen parameter now trains: what each raised,
    and whether the model is as before the load."""
    outcome = {}
    for name, path in (("bcp", bcp_dir), ("torch_dist", reference_dir)):
        with cpu_megatron_optimizer(), parallel():
            model, ddp, optimizer = build(seed=2, frozen=False)
            train_step(ddp, optimizer, 0)
            before = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
            outcome[name] = raised(lambda: _as_exception(model, optimizer, path))
            after = model.state_dict()
            outcome[f"{name} unchanged"] = all(torch.equal(v, after[k]) for k, v in before.items())
    return outcome


def _as_exception(model, optimizer, path: str) -> None:
    """``dist_checkpointing.load`` of model and optimizer (the optimizer has stepped, so no priming);
    torch's ``CheckpointException``, which torch_dist raises, is a ``BaseException``: re-raised as an
    ``Exception`` for :func:`megatron_parts.raised`."""
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.load(sharded_state(model, optimizer, FULLY_RESHARDABLE, is_loading=True), path)
    except BaseException as exc:  # noqa: B036  (only CheckpointException reaches here unconverted)
        if isinstance(exc, Exception):
            raise
        raise RuntimeError(str(exc)) from exc


def test_frozen_parameter_loads_as_torch_dist_loads_it(ranks, tmp_path):
    # Named as Megatron-LM names the folder of iteration 1: the generation records that step.
    dirs = (str(tmp_path / "iter_0000001"), str(tmp_path / "torch_dist"))
    for path in dirs:
        os.makedirs(path)
    expected_losses = ranks(2).run(save_frozen, *dirs)
    assert open_checkpoint(dirs[0]).manifest.step == 1
    for expected_loss, outcome in zip(expected_losses, ranks(2).run(load_frozen, *dirs)):
        (loaded, loss), (reference, reference_loss) = outcome["bcp"], outcome["torch_dist"]
        assert loaded.keys() == reference.keys()
        assert not any(FROZEN in key for key in loaded if key.startswith("optimizer."))
        for key, value in reference.items():
            assert torch.equal(value.view(-1).view(torch.uint8), loaded[key].view(-1).view(torch.uint8)), key
        assert loss == reference_loss == expected_loss

    for outcome in ranks(2).run(load_unfrozen, *dirs):
        assert outcome["torch_dist"] != ("nothing raised",)  # Megatron's own backend refuses too (a DCP error)
        assert f"optimizer.state.param.{FROZEN} from model not in state dict" in outcome["torch_dist"][2]
        is_megatron, bcp_class, message = outcome["bcp"]
        assert (is_megatron, bcp_class) == (True, "MismatchError"), outcome["bcp"]
        missing = sorted(f"optimizer.state.{kind}.{FROZEN}" for kind in ("exp_avg", "exp_avg_sq", "param"))
        assert f"3 requested sharded key(s) are not in the checkpoint: {', '.join(missing)};" in message, message
        assert outcome["bcp unchanged"]  # (torch_dist's failed load has written into some model tensors)
