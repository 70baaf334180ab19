"""Real Megatron-Core parts on the CPU for the bcp-megatron cases: a small GPTModel in any TP/PP
layout, Megatron's DistributedOptimizer (with the CPU patches it needs), and the assembly of
every rank's ShardedTensor pieces into whole tensors for bitwise comparison."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
import torch.distributed as dist

import bcp

VOCAB, SEQ, HIDDEN, HEADS = 64, 8, 16, 4


@contextlib.contextmanager
def parallel(tp: int = 1, pp: int = 1, ep: int = 1) -> Iterator[None]:
    """Megatron's process groups for this case, destroyed afterwards (the rank pool is shared).
    Megatron's ``destroy_model_parallel`` only forgets its groups: each gloo group would keep its
    threads for the pool's life (800 per rank after the resharding tests, slowing every later case),
    so the groups created during the case are destroyed here."""
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    before = set(distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        for group in [g for g in distributed_c10d._world.pg_map if g not in before]:
            torch.distributed.destroy_process_group(group)


def gpt(seed: int, num_layers: int = 4, tied: bool = True, experts: int | None = None) -> torch.nn.Module:
    """This rank's stage of a GPTModel in the current parallel layout (deterministic per seed);
    with ``experts``, every layer's MLP is a mixture of that many experts (top-2 router, one
    ``SequentialMLP`` of local experts per expert-parallel rank, Megatron's allgather dispatcher)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,  # losses compare across layouts
        num_moe_experts=experts, expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        moe_router_topk=2, moe_token_dispatcher_type="allgather",
        # Without Transformer Engine an expert's bias is added in place to a tensor-parallel
        # reduction's output, which autograd refuses (mlp.py:247 in 0.16.1): MoE layers get no biases.
        add_bias_linear=experts is None)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=tied)


def scramble(model: torch.nn.Module) -> None:
    """Overwrite every parameter, so a load that leaves one untouched is caught."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-7.0)


def main_pieces(sharded_state_dict: Any) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """This rank's main-replica tensor pieces as ``(key, global shape, offsets, box-shaped copy)``,
    without the distributed optimizer's padding pieces (uninitialised memory, marked ``padding``)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor, is_main_replica

    if isinstance(sharded_state_dict, dict):
        padding = sharded_state_dict.get("padding")
        if isinstance(padding, LocalNonpersistentObject) and padding.unwrap():
            return []
        return [piece for value in sharded_state_dict.values() for piece in main_pieces(value)]
    if isinstance(sharded_state_dict, list):
        return [piece for value in sharded_state_dict for piece in main_pieces(value)]
    value = sharded_state_dict
    if not (isinstance(value, ShardedTensor) and is_main_replica(value.replica_id)):
        return []
    data = value.data.detach().clone()
    for _ in range(value.prepend_axis_num):
        data = data.unsqueeze(0)
    return [(value.key, tuple(value.global_shape), tuple(value.global_offset), data)]


def assemble(per_rank: list[list[tuple[str, tuple, tuple, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's main pieces (zeros where only padding lies); no element may
    be covered twice."""
    full: dict[str, torch.Tensor] = {}
    count: dict[str, torch.Tensor] = {}
    for pieces in per_rank:
        for key, shape, offsets, data in pieces:
            region = tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))
            full.setdefault(key, torch.zeros(shape, dtype=data.dtype))[region] = data
            count.setdefault(key, torch.zeros(shape, dtype=torch.int32))[region] += 1
    for key, seen in count.items():
        assert torch.all(seen <= 1), f"{key}: main replicas overlap"
    return full


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys(), sorted(expected.keys() ^ actual.keys())
    for key, value in expected.items():
        other = actual[key]
        assert value.dtype == other.dtype and value.shape == other.shape, key
        assert torch.equal(value.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), key


def raised(call) -> tuple:
    """``(CheckpointingException?, bcp.CheckpointError class name or None, message)`` of what ``call`` raises."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        call()
    except Exception as exc:  # the outcome under test
        return (isinstance(exc, CheckpointingException),
                type(exc).__name__ if isinstance(exc, bcp.CheckpointError) else None, str(exc))
    return ("nothing raised",)


class NoStream:
    """A CUDA stream on the CPU, where there is one order of work."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: NoStream) -> None:
        pass


def cuda_runtime_on_cpu() -> None:
    """Patches this process for good: the CUDA generator, whose state Megatron checkpoints
    (``get_rng_state``), is a CPU generator of its own, and streams are no-ops (Megatron-LM's
    ``get_model`` builds DDP on a side stream)."""
    generator = torch.Generator()
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda device="cuda": generator.get_state()
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = (
        lambda state, device="cuda": generator.set_state(state))
    torch.cuda.manual_seed = lambda seed: generator.manual_seed(seed)
    torch.cuda.Stream = NoStream
    torch.cuda.current_stream = lambda device=None: NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()


def rank() -> int:
    return dist.get_rank()


def torch_on_cpu() -> types.ModuleType:
    """``torch`` for a Megatron module's globals, whose tensor factories put ``device='cuda'`` on the CPU."""

    class CpuTorch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    def on_cpu(factory: Any) -> Any:
        def make(*args: Any, device: Any = None, **kwargs: Any) -> Any:
            return factory(*args, device="cpu" if device is not None and "cuda" in str(device) else device, **kwargs)
        return make

    cpu_torch = CpuTorch("torch")
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(cpu_torch, name, on_cpu(getattr(torch, name)))
    return cpu_torch


@contextlib.contextmanager
def cpu_megatron_optimizer() -> Iterator[None]:
    """Megatron's DDP and DistributedOptimizer assume CUDA (``device='cuda'`` tensors, type names
    like ``torch.cuda.FloatTensor``); these patches map them to the CPU for the duration of a case
    and restore everything after. They are the test's business: bcp's own path needs none."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer_module
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.utils as core_utils
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    cpu_torch = torch_on_cpu()
    tensor_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        return tensor_type(self).replace("torch.", "torch.cuda.", 1)

    saved = [(torch.cuda, "current_device", torch.cuda.current_device),
             (torch.cuda, "synchronize", torch.cuda.synchronize),
             (torch.Tensor, "cuda", torch.Tensor.cuda),
             (torch.nn.Parameter, "type", torch.nn.Parameter.__dict__.get("type")),
             (CudaRNGStatesTracker, "fork", CudaRNGStatesTracker.fork),
             (moe_utils, "te_general_gemm", moe_utils.__dict__.get("te_general_gemm")),
             (DistributedOptimizer, "_set_main_param_and_optimizer_states",
              DistributedOptimizer._set_main_param_and_optimizer_states),
             *[(m, "torch", m.torch) for m in (clip_grads, optimizer_module, schedules, core_utils)]]
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Parameter.type = cuda_type
    # Tensor-parallel layers fork the CUDA generator around dropout; these models have none.
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    # The MoE router's GEMM tests 'te_general_gemm is not None', a name Megatron binds only when
    # Transformer Engine imports (NameError without it); None selects its torch.mm path.
    moe_utils.te_general_gemm = None
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states_keeping_step(
        DistributedOptimizer._set_main_param_and_optimizer_states)
    for module in (clip_grads, optimizer_module, schedules, core_utils):
        module.torch = cpu_torch
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _set_states_keeping_step(megatron_set_states: Any) -> Any:
    """Without Apex or Transformer Engine, torch's Adam keeps a 'step' per parameter, which the
    model-space formats (``fully_reshardable``) do not carry: Megatron's setter then fails with
    ``KeyError: 'step'`` (distrib_optimizer.py:940 in 0.16.1). The parameter's own step is passed
    through unchanged; :func:`restore_steps` sets it from the checkpoint's param groups afterwards."""

    def set_states(self: Any, model_param: Any, tensors: dict) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        megatron_set_states(self, model_param, tensors)
    return set_states


def distributed_optimizer(model: torch.nn.Module) -> tuple[Any, Any]:
    """Megatron DDP around ``model`` and a DistributedOptimizer (Adam) over it (inside
    :func:`cpu_megatron_optimizer`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                  model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True,
                        clip_grad=0.0), [ddp])
    return ddp, optimizer


def step(model: torch.nn.Module, optimizer: Any, seed: int) -> None:
    """One optimizer step with gradients that depend only on the parameter names and ``seed``
    (identical on every data-parallel rank, so no gradient reduction is needed)."""
    for name, param in model.named_parameters():
        g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
        param.main_grad.copy_(torch.randn(param.shape, generator=g))
    updated, _, _ = optimizer.step()
    assert updated


def prime_for_load(optimizer: Any) -> None:
    """Without Apex or Transformer Engine, a DistributedOptimizer that never stepped has no 'step'
    to build its state dict from; Megatron's own dummy-state initialisation gives it one (the
    loaded checkpoint then overwrites parameters and state)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner._init_optimizer_states_with_dummy_values()


def restore_steps(optimizer: Any) -> None:
    """Without Apex or Transformer Engine, Megatron's DistributedOptimizer runs torch's Adam, which keeps
    a 'step' per parameter. Its load_state_dict puts the checkpoint's step in ``param_groups`` only:
    the state is left with one tensor shared by every parameter (which Adam would advance once per
    parameter) that holds the fresh optimizer's step (written back by
    ``_set_main_param_and_optimizer_states``). Each parameter gets its own copy of the loaded step,
    as after a regular step; groups nothing was loaded into (no 'step') are left alone."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"] if "step" in group else []:
                inner.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))


def save_torch_dist(sharded_state_dict: Any, path: str) -> None:
    """``dist_checkpointing.save`` with Megatron's torch_dist strategy, from a rank-pool worker.

    torch_dist's writer forks a process per file bucket and keeps a multiprocessing Manager for
    their results; the pool's workers are daemonic, and multiprocessing refuses children to those.
    The refusal is lifted for the save (the writers are joined before it returns), and Megatron's
    cached Manager is dropped afterwards, which shuts its server process down."""
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        dist_checkpointing.save(sharded_state_dict, path, sharded_strategy=("torch_dist", 1))
    finally:
        config["daemon"] = daemon
        filesystem_async._results_queue = None


def sharded_state(model: torch.nn.Module, optimizer: Any, metadata: dict, is_loading: bool = False) -> dict:
    """The model's and the DistributedOptimizer's sharded state dicts, the optimizer's in the
    format ``metadata`` names (``distrib_optim_sharding_type``)."""
    model_sd = model.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def load_model_and_optimizer(model: torch.nn.Module, optimizer: Any, path: str, metadata: dict) -> None:
    """``dist_checkpointing.load`` of model and optimizer from ``path`` (the backend named in its
    metadata.json), with the stand-ins torch's Adam needs before and after (see each)."""
    from megatron.core import dist_checkpointing

    prime_for_load(optimizer)
    loaded = dist_checkpointing.load(sharded_state(model, optimizer, metadata, is_loading=True), path)
    model.load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 parameters are their own main copies: views that require grad
        optimizer.load_state_dict(loaded["optimizer"])
    restore_steps(optimizer)
