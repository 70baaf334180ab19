"""Megatron-LM's own ``save_checkpoint`` and ``load_checkpoint`` (megatron/training/checkpointing.py)
on the CPU, with ``--ckpt-format bcp`` handled by bcp_megatron's launcher. Run by
test_megatron_lm_checkpointing.py as::

    python -m torch.distributed.run --nproc-per-node 2 -m bcp_megatron.launch THIS_FILE \\
        --case-out OUT --case-phase save|load <Megatron-LM arguments> --ckpt-format bcp

Megatron-LM parses the arguments (``initialize_megatron``) and builds the GPTModel of
``pretrain_gpt.py``, its DDP, DistributedOptimizer and scheduler with ``setup_model_and_optimizer``,
which also calls ``load_checkpoint``. ``save``: one optimizer step, ``save_checkpoint``, then a second
``setup_model_and_optimizer`` loads it back. ``load`` (another TP size): setup only. Each rank writes
what it saw to ``OUT/<phase>-rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def case_args(parser):
    group = parser.add_argument_group("bcp test case")
    group.add_argument("--case-out", required=True)
    group.add_argument("--case-phase", choices=("save", "load"), required=True)
    return parser


def setup():
    """Megatron-LM's model, optimizer and scheduler, loaded from ``--load`` when it holds a checkpoint."""
    from gpt_builders import gpt_builder
    from megatron.core.enums import ModelType
    from megatron.training.training import setup_model_and_optimizer
    from model_provider import model_provider

    return setup_model_and_optimizer(partial(model_provider, gpt_builder), ModelType.encoder_or_decoder)


def snapshot(model: list, optimizer) -> dict:
    """This rank's main-replica pieces of the model and of the optimizer state in model space
    (Megatron's fully reshardable view of it), comparable across TP sizes."""
    from megatron.training.utils import unwrap_model
    from megatron_parts import main_pieces

    model_sd = unwrap_model(model)[0].sharded_state_dict()
    view = optimizer.sharded_state_dict(model_sd, is_loading=False,
                                        metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return {"model": main_pieces(model_sd), "optimizer": main_pieces(view)}


def rng_states() -> dict:
    from megatron.core import tensor_parallel

    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def main() -> None:
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron_lm_cpu import run_on_cpu
    from megatron_parts import cpu_megatron_optimizer, step

    run_on_cpu()
    with cpu_megatron_optimizer():
        initialize_megatron(extra_args_provider=case_args, allow_no_cuda=True)
        args = get_args()
        result = {"ckpt_format": args.ckpt_format}
        model, optimizer, scheduler = setup()
        if args.case_phase == "save":
            assert args.iteration == 0, "--load must start empty"
            step(model[0], optimizer, seed=1)
            scheduler.step(increment=args.global_batch_size)
            result["rng"] = rng_states()
            save_checkpoint(1, model, optimizer, scheduler, num_floating_point_operations_so_far=123)
            result["saved"] = snapshot(model, optimizer)
            result["scheduler"] = scheduler.state_dict()
            torch.manual_seed(args.seed + 1)  # so that the new model and the RNG states restored into it
            torch.cuda.manual_seed(args.seed + 1)  # can only match the saved ones through the checkpoint
            model, optimizer, scheduler = setup()  # a new model, loaded by Megatron-LM's load_checkpoint
            result["loaded rng"] = rng_states()
        result.update(loaded=snapshot(model, optimizer), iteration=args.iteration,
                      flops=args.num_floating_point_operations_so_far, **{"loaded scheduler": scheduler.state_dict()})
    rank = torch.distributed.get_rank()
    torch.save(result, os.path.join(args.case_out, f"{args.case_phase}-rank{rank}.pt"))


if __name__ == "__main__":
    main()
