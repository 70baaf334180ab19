"""One real Megatron training step on the CPU: Megatron's own ``forward_backward_func`` (the 1F1B
pipeline schedule when PP > 1, gloo point-to-point between stages), its gradient finalisation
(data-parallel reduce-scatter, pipeline embedding sync) and the DistributedOptimizer's step.

The global batch is fixed per step number and split over the data-parallel ranks, each running its
share as micro-batches of one sequence, so every layout trains on the same data and the losses of
different layouts agree up to the floating-point order of their reductions. Used inside
``megatron_parts.cpu_megatron_optimizer``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_parts import SEQ, VOCAB

GLOBAL_BATCH = 4
CAUSAL = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: masked out


def global_batch(step: int) -> torch.Tensor:
    """The ``GLOBAL_BATCH`` sequences (one token longer than ``SEQ``, for the labels) of ``step``."""
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _forward_step(data: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    sequence = next(data).unsqueeze(0)
    tokens, labels = sequence[:, :-1], sequence[:, 1:]
    output = model(tokens, torch.arange(SEQ).unsqueeze(0), CAUSAL, labels=labels)

    def loss(per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
        mean = per_token.float().mean()
        return mean, {"loss": mean.detach().clone()}  # the schedule divides the first in place
    return output, loss


def train_step(ddp: Any, optimizer: Any, step: int) -> float:
    """Runs training step ``step`` and returns its loss (the global batch's mean, on every rank)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    sequences = list(global_batch(step)[dp_rank::dp_size])
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(sequences), model=[ddp],
        num_microbatches=len(sequences), seq_length=SEQ, micro_batch_size=1)
    updated, _, _ = optimizer.step()
    assert updated
    # Only the last stage has losses, and its tensor-parallel ranks hold the same ones: count one.
    counted = losses if parallel_state.get_tensor_model_parallel_rank() == 0 else []
    total = torch.tensor(sum(float(item["loss"]) for item in counted), dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / GLOBAL_BATCH
