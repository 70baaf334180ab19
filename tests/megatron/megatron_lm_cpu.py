"""Megatron-LM's training code (0.16, 0.17) on the CPU, for the opt-in tests; patches this process only.

Megatron-LM assumes CUDA devices throughout. Each patch says what it stands in for; none touches
the checkpointing logic: ``save_checkpoint``, ``load_checkpoint`` and bcp run as they are. Used
together with ``megatron_parts.cpu_megatron_optimizer`` (Megatron-Core's DDP and optimizer).
"""

from __future__ import annotations

import functools
import importlib
import types

import torch

# Modules on the paths run here that create their small bookkeeping tensors (iteration numbers,
# timestamps, loss sums, rerun flags, token counts) with device='cuda': those go to the CPU.
CUDA_TENSOR_MODULES = (
    "megatron.training.checkpointing", "megatron.training.training", "megatron.training.utils",
    "megatron.core.rerun_state_machine", "megatron.core.timers", "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils", "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.utils", "megatron.core.tensor_parallel.mappings",
    "megatron.core.distributed.distributed_data_parallel", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.attention", "megatron.core.models.gpt.gpt_model",
)


def run_on_cpu() -> None:
    from megatron.training import initialize, training
    from megatron_parts import cuda_runtime_on_cpu, prime_for_load, restore_steps, torch_on_cpu

    cuda_runtime_on_cpu()
    # initialize_megatron builds Megatron's process groups and RNG tracker only when it sees a device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    # validate_args asks for the GPU generation (TP then needs CUDA_DEVICE_MAX_CONNECTIONS=1, set by the test)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=0, minor=0)
    # get_model moves the model to "the device"
    torch.nn.Module.cuda = lambda self, device=None: self
    for name in CUDA_TENSOR_MODULES:
        importlib.import_module(name).torch = torch_on_cpu()
    # pretrain() asserts CUDA unless told otherwise, and warms up fused kernels with CUDA tensors
    training.initialize_megatron = functools.partial(training.initialize_megatron, allow_no_cuda=True)
    initialize._warmup_jit_function = lambda: None
    try:  # Megatron-LM 0.16 "loads" its legacy fused CUDA kernels with nvcc (none is used by this model)
        from megatron.legacy import fused_kernels
    except ImportError:  # 0.17 has none
        pass
    else:
        fused_kernels.load = lambda args: None

    # Without Apex or Transformer Engine (torch's Adam), a DistributedOptimizer that never stepped has
    # no 'step' state, which load_checkpoint's state_dict() asserts on: Megatron's dummy step primes
    # it. After the load, each parameter's step is set from the checkpoint (megatron_parts.restore_steps).
    build_optimizer, load_checkpoint = training.get_megatron_optimizer, training.load_checkpoint

    def megatron_optimizer(*args, **kwargs):
        optimizer = build_optimizer(*args, **kwargs)
        load = training.get_args().load
        if load and training.checkpoint_exists(load):
            prime_for_load(optimizer)
        return optimizer

    def load_with_steps(model, optimizer, *args, **kwargs):
        loaded = load_checkpoint(model, optimizer, *args, **kwargs)
        if optimizer is not None:
            restore_steps(optimizer)
        return loaded

    training.get_megatron_optimizer = megatron_optimizer
    training.load_checkpoint = load_with_steps
