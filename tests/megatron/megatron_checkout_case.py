"""The Megatron-Core of a Megatron-LM checkout (on PYTHONPATH) round-trips a GPTModel through bcp,
with the strategies passed explicitly (the only way on Megatron-Core 0.17+): saved at TP=2, loaded
at TP=1 on two ranks. Run by test_megatron_lm.py as ``python megatron_checkout_case.py OUT_DIR``;
each rank writes its pieces to ``OUT_DIR/rank<r>.pt``."""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(300, exit=True)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    import megatron.core
    from megatron.core import dist_checkpointing
    from megatron_parts import gpt, main_pieces, parallel, scramble

    import bcp_megatron

    path = os.path.join(out, "ckpt")
    os.makedirs(path, exist_ok=True)
    with parallel(tp=2):
        model = gpt(seed=1)
        save = bcp_megatron.BcpSaveShardedStrategy()
        dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=save)
        saved = main_pieces(model.sharded_state_dict())
        wrapped = os.path.join(out, "wrapped")
        os.makedirs(wrapped, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), wrapped, sharded_strategy=fully_parallel(save))
    with parallel(tp=1):
        model = gpt(seed=2)
        scramble(model)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), path,
                                         sharded_strategy=bcp_megatron.BcpLoadShardedStrategy())
        model.load_state_dict(loaded)
        result = {"version": megatron.core.__version__, "saved": saved,
                  "loaded": main_pieces(model.sharded_state_dict()),
                  "metadata": open(os.path.join(path, "metadata.json")).read(),
                  "wrapped metadata": open(os.path.join(wrapped, "metadata.json")).read(),
                  "torch_dist through bcp's load strategy": torch_dist_through_bcp(out, model)}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def fully_parallel(strategy):
    """Megatron-LM's default wrapping of the save strategy (bcp's honest subclass on 0.17+)."""
    from megatron.core.dist_checkpointing.strategies import base

    if hasattr(base, "register_default_strategy"):  # <= 0.16: Megatron's wrapper takes the backend from bcp
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    else:
        from bcp_megatron.strategies_torch_dist import FullyParallelSaveStrategyWrapper
    return FullyParallelSaveStrategyWrapper(strategy)


def torch_dist_through_bcp(out: str, model: torch.nn.Module) -> str:
    """0.17+: bcp's load strategy hands torch_dist checkpoints to torch_dist; <= 0.16: it refuses them
    (there, dist_checkpointing.load itself dispatches on metadata.json)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    import bcp_megatron

    torch.cuda.synchronize = lambda *a, **k: None  # torch_dist synchronises CUDA; nothing to do on the CPU
    torch.cuda.current_device = lambda: "cpu"
    path = os.path.join(out, "torch_dist")
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), path)  # torch_dist is the default
    try:
        dist_checkpointing.load(model.sharded_state_dict(), path,
                                sharded_strategy=bcp_megatron.BcpLoadShardedStrategy())
    except CheckpointingException as exc:
        return f"refused: {exc}"
    return "loaded"


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, sys.argv[1]), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
