"""bcp against Megatron's own torch_dist backend on the same GPTModel (CPU, gloo).

    python examples/megatron/benchmark.py [--ranks 2] [--tp 1] [--hidden 512] [--layers 8] [--saves 3]

torch_dist runs the way Megatron-LM runs it by default: wrapped in FullyParallelSaveStrategyWrapper
(the save spread over data-parallel replicas), with the constant-structure cache on
(``--ckpt-assume-constant-structure``). Each save goes to a new directory, as in training. Reported
per backend: the first save, the median of the later (cached) saves, the time an asynchronous save
blocks training (until ``schedule_async_request`` returns) and the time until it is committed, and
a load. Megatron's torch_dist calls CUDA for synchronisation; on the CPU those calls become no-ops
here (bcp needs none).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build(args: argparse.Namespace) -> torch.nn.Module:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                               use_cpu_initialization=True,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=128)


def strategy(backend: str):
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from bcp_megatron import BcpSaveShardedStrategy

    if backend == "bcp":
        return BcpSaveShardedStrategy()
    return FullyParallelSaveStrategyWrapper(
        TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True),
        parallel_state.get_data_parallel_group(with_context_parallel=True), do_cache_distribution=True)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def run_backend(backend: str, model: torch.nn.Module, root: str, saves: int) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    save_strategy = strategy(backend)
    paths = []

    def fresh_dir() -> str:
        path = os.path.join(root, backend, f"iter_{len(paths):04d}")
        if dist.get_rank() == 0:
            os.makedirs(path)
        dist.barrier()
        paths.append(path)
        return path

    sync = [timed(lambda: dist_checkpointing.save(model.sharded_state_dict(), fresh_dir(), save_strategy))
            for _ in range(saves)]
    queue = AsyncCallsQueue()
    path = fresh_dir()
    start = time.perf_counter()
    request = dist_checkpointing.save(model.sharded_state_dict(), path, save_strategy, async_sharded_save=True)
    queue.schedule_async_request(request)
    blocked = time.perf_counter() - start
    queue.maybe_finalize_async_calls(blocking=True)
    committed = time.perf_counter() - start
    queue.close()
    load = timed(lambda: dist_checkpointing.load(model.sharded_state_dict(), paths[0]))
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(paths[0]) for f in files)
    return {"first_save_s": sync[0], "cached_save_s": statistics.median(sync[1:]), "async_blocking_s": blocked,
            "async_committed_s": committed, "load_s": load, "checkpoint_mb": nbytes / 2**20}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state

    import bcp_megatron  # noqa: F401

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model = build(args)
    params = sum(p.numel() for p in model.parameters())
    results = {backend: run_backend(backend, model, root, args.saves) for backend in ("torch_dist", "bcp")}
    if rank == 0:
        print(json.dumps({"ranks": world, "tp": args.tp, "params_per_rank": params, **results}, indent=2))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bcp-megatron-bench-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(rank_main, args=(args.ranks, port, args, root), nprocs=args.ranks, start_method="spawn")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
