"""Checkpoint every step to node memory and lose at most one step when a rank dies under torchrun.

Run it (CPU, 2 processes posing as 2 nodes, torchrun restarting the workers once if one dies):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 1 examples/every_step_torchrun.py --tier-dir /tmp/bcp-tier --nodes a,b --steps 200

and `kill -9` one of the workers (each prints its pid) while it trains: torchrun starts both again, they
load the newest generation committed in the tier and continue; each prints its per-step loss.

Each step saves the model and the AdamW state to a ``bcp.MemoryTier`` asynchronously (the files go
to the node's folder and a copy to the peer node's folder, in the background). The step after waits
for that save to commit before saving again, so when a step's loss is printed the step before is
committed: a rank killed at any moment costs at most the step it was in and the one printed last.

The process group is set up so that torchrun's restarts can form it (``init_process_group`` below;
``docs/memory-tier.md``, "Recovery under torchrun"): the restarted workers meet in the store of the
first attempt, where the dead workers' addresses are still written, and a plain
``init_process_group`` there fails now and then with "Connection refused".
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a store of its own (required with
several nodes under the c10d rendezvous).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

STARTED = time.time()  # before importing torch: the recovery's breakdown counts the imports as restart

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import bcp  # noqa: E402

GLOBAL_BATCH = 32


def build(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One step on this rank's share of the global batch of ``step`` (the same data on any attempt);
    returns the global batch's loss."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=generator)
    y = x[:, :4].sin()
    share = GLOBAL_BATCH // dist.get_world_size()
    rows = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
    loss = nn.functional.mse_loss(model(x[rows]), y[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    loss = loss.detach()
    dist.all_reduce(loss)
    return (loss / dist.get_world_size()).item()


def say(line: str) -> None:
    """One write per line: the ranks share torchrun's stdout, where print() may write a line's end apart."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def init_process_group(timeout: datetime.timedelta) -> None:
    """The process group, keyed by torchrun's attempt where the launcher's store outlives attempts.

    torchrun's agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``) for the whole run, and the
    process group's setup keys each rank's address by rank alone: a restarted worker could read the
    address a dead worker of the previous attempt wrote there and fail to connect. Keyed by the
    attempt, it reads only its own attempt's. Every agent counts the same attempts with the static
    rendezvous and on one node; with several nodes under the c10d rendezvous an agent does not count
    a restart that another node caused, so there run torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` instead: each attempt then gets a store of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)
        return
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timeout)
    store = dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", agent_store)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier-dir", required=True, help="the node-local folder of the memory tier")
    parser.add_argument("--nodes", help="the node id of each rank, comma separated (default: the host names)")
    parser.add_argument("--steps", type=int, default=50, help="train until this step")
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's width")
    parser.add_argument("--no-checkpoint", action="store_true", help="train without saving or loading")
    args = parser.parse_args()

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = int(os.environ["RANK"])
    say(f"[rank {rank}] attempt {attempt} pid {os.getpid()} started {STARTED:.6f} imported {time.time():.6f}")
    torch.set_num_threads(1)
    init_process_group(datetime.timedelta(seconds=30))
    say(f"[rank {rank}] process group {time.time():.6f}")

    model, optimizer = build(args.hidden)
    say(f"[rank {rank}] built {time.time():.6f}")
    progress = {"step": 0}
    state = {"model": model, "optimizer": optimizer, "extra_state": progress}
    tier = bcp.MemoryTier(None, local_dir=args.tier_dir, nodes=args.nodes.split(",") if args.nodes else None)
    if not args.no_checkpoint:
        try:
            result = bcp.load(tier, state)
            say(f"[rank {rank}] resumed after step {progress['step']} from generation {result.generation} "
                  f"({result.source})")
        except bcp.CheckpointNotFoundError:
            pass  # a fresh run
    say(f"[rank {rank}] loaded {time.time():.6f}")

    pending = None
    for step in range(progress["step"] + 1, args.steps + 1):
        loss = train_step(model, optimizer, step)
        if pending is not None:
            pending.wait()  # the previous step committed: a kill from here on repeats at most this step
        say(f"[rank {rank}] step {step} loss {loss.hex()} done {time.time():.6f}")
        if not args.no_checkpoint:
            progress["step"] = step
            pending = bcp.save(tier, state, async_save=True)
    if pending is not None:
        pending.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
