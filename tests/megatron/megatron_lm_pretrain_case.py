"""The checkout's own ``pretrain_gpt.py`` on the CPU. Run by test_megatron_lm_checkpointing.py as::

    BCP_MEGATRON_LM=CHECKOUT BCP_CASE_LOSSES=OUT python -m torch.distributed.run --nproc-per-node 2 \\
        -m bcp_megatron.launch THIS_FILE <pretrain_gpt.py arguments> --ckpt-format bcp

Each rank writes every iteration's losses, exactly as ``training_log`` receives them, to
``OUT-rank<r>.pt``: Megatron-LM's printed losses are rounded, and the first interval after a resume
averages two iterations (``training_log`` does not reset its sums on a run's first iteration).
"""

import inspect
import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_lm_cpu import run_on_cpu
from megatron_parts import cpu_megatron_optimizer


def record_losses(path: str) -> None:
    from megatron.training import training

    log, losses = training.training_log, {}

    def training_log(*args, **kwargs):
        seen = inspect.signature(log).bind(*args, **kwargs).arguments
        losses[seen["iteration"]] = {key: value.clone() for key, value in seen["loss_dict"].items()}
        torch.save(losses, f"{path}-rank{torch.distributed.get_rank()}.pt")
        return log(*args, **kwargs)

    training.training_log = training_log


if __name__ == "__main__":
    run_on_cpu()
    record_losses(os.environ["BCP_CASE_LOSSES"])
    with cpu_megatron_optimizer():
        runpy.run_path(os.path.join(os.environ["BCP_MEGATRON_LM"], "pretrain_gpt.py"), run_name="__main__")
