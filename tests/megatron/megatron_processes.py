"""Cases that need processes of their own (run by test_megatron_processes.py as
``python megatron_processes.py OUT_DIR``): Megatron's torch_dist backend and its asynchronous queue
fork writer processes, which the daemonic rank pool may not do.

Two gloo ranks (TP=2) run every case and write their results to ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WORLD = 2
HANG_S = 300


def cpu_torch_dist() -> None:
    """Megatron's torch_dist backend and async queue call CUDA for synchronisation and their small
    all-reduces; on the CPU those become no-ops and CPU tensors (this process only)."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def async_save_keeps_its_snapshot(out: str) -> dict:
    """Megatron's AsyncCallsQueue runs bcp's request; training changes the weights meanwhile."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron_parts import gpt, main_pieces, parallel, scramble

    path = os.path.join(out, "async")
    with parallel(tp=2):
        model = gpt(seed=1)
        snapshot = main_pieces(model.sharded_state_dict())
        os.makedirs(path, exist_ok=True)
        queue = AsyncCallsQueue()
        request = dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=("bcp", 1),
                                          async_sharded_save=True)
        queue.schedule_async_request(request)
        scramble(model)  # training goes on while the save is in flight
        polls = 0
        while not queue.maybe_finalize_async_calls(blocking=False):
            polls += 1
            time.sleep(0.01)
        queue.close()
        fresh = gpt(seed=2)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), path))
        return {"snapshot": snapshot, "loaded": main_pieces(fresh.sharded_state_dict()), "polls": polls,
                "metadata": open(os.path.join(path, "metadata.json")).read()}


def backends_are_not_confused(out: str) -> dict:
    """A torch_dist checkpoint and a bcp one side by side: default dispatch, and each backend's load
    strategy forced onto the other's checkpoint."""
    import bcp
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint.api import CheckpointException
    from megatron_parts import gpt, main_pieces, parallel

    from bcp_megatron import BcpLoadShardedStrategy

    result: dict = {}
    with parallel(tp=2):
        model = gpt(seed=1)
        for backend in ("torch_dist", "bcp"):
            path = os.path.join(out, backend)
            os.makedirs(path, exist_ok=True)
            dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=(backend, 1))
            fresh = gpt(seed=2)
            fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), path))
            result[f"default load of {backend}"] = main_pieces(fresh.sharded_state_dict())
        result["saved"] = main_pieces(model.sharded_state_dict())
        for strategy, backend in ((BcpLoadShardedStrategy(), "torch_dist"), (TorchDistLoadShardedStrategy(), "bcp")):
            try:
                dist_checkpointing.load(gpt(seed=3).sharded_state_dict(), os.path.join(out, backend),
                                        sharded_strategy=strategy)
                result[f"{type(strategy).__name__} on {backend}"] = "loaded"
            except (Exception, CheckpointException) as exc:  # the outcome under test (DCP's is a BaseException)
                result[f"{type(strategy).__name__} on {backend}"] = f"{type(exc).__name__}: {exc}"
        try:
            bcp.load(os.path.join(out, "torch_dist"), {"model": {}})
        except bcp.CheckpointError as exc:
            result["bcp.load on torch_dist"] = f"{type(exc).__name__}: {exc}"
    return result


CASES = [async_save_keeps_its_snapshot, backends_are_not_confused]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang fails with every thread's stack
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    cpu_torch_dist()
    import bcp_megatron  # noqa: F401  (registers the 'bcp' backend)

    results = {}
    for case in CASES:
        try:
            results[case.__name__] = case(out)
        except Exception:
            results[case.__name__] = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, out), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
