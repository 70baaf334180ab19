"""bcp in one minute: train on 2 CPU processes with FSDP2, save, then resume on 1 process and on 3.

    make demo            (or: .venv/bin/python examples/demo.py [checkpoint-dir])

Every tensor of the model and of the AdamW state is compared bit for bit with what was saved.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import bcp


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 30)
        self.hidden = nn.Linear(30, 31)  # 31 rows: uneven over 2 and 3 ranks
        self.head = nn.Linear(31, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(torch.tanh(self.embed(x)))))


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.embed, model.hidden, model.head):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, world: int, rank: int) -> float:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, 16, generator=g), torch.randn(24, 5, generator=g)
        per = 24 // world
        loss = nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    loss = loss.detach()
    if world > 1:  # the global batch's loss, comparable across layouts
        dist.all_reduce(loss)
        loss /= world
    return loss.item()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    out = {f"model.{k}": whole(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, per_param in optimizer.state.items():
        out.update({f"optim.{names[id(p)]}.{k}": whole(v) for k, v in per_param.items()})
    return out


def run_ranks(world: int, fn, *args) -> list:
    with tempfile.TemporaryDirectory(prefix="bcp-demo-ranks-") as meeting:
        # The ranks meet through a file, not a TCP port chosen in advance that another program
        # could take before rank 0 listens on it; each leaves its result in a file of its own (a
        # pipe read only after the join would block a rank whose result outgrows its buffer).
        init = f"file://{os.path.join(meeting, 'store')}"
        mp.spawn(_rank_main, args=(world, init, meeting, fn, args), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(_result_file(meeting, rank), "rb") as f:
                results.append(pickle.load(f))  # written by this demo's own ranks just now
    return results


def _result_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"result-{rank}.pickle")


def _rank_main(rank: int, world: int, init: str, folder: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, world, *args)
        with open(_result_file(folder, rank), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def save_phase(rank: int, world: int, path: str):
    model, optimizer = build(world)
    loss = train(model, optimizer, range(5), world, rank)
    handle = bcp.save(path, {"model": model, "optimizer": optimizer, "extra_state": {"step": 5}})
    state = full_state(model, optimizer)
    return (loss, handle.stats, state) if rank == 0 else None


def resume_phase(rank: int, world: int, path: str):
    model, optimizer = build(world)
    state = {"model": model, "optimizer": optimizer, "extra_state": None}
    result = bcp.load(path, state)
    loaded = full_state(model, optimizer)
    loss = train(model, optimizer, range(state["extra_state"]["step"], 7), world, rank)
    return (loaded, result, loss) if rank == 0 else None


def compare(reference: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> int:
    assert reference.keys() == loaded.keys(), sorted(reference.keys() ^ loaded.keys())
    for name, value in reference.items():
        if not torch.equal(value, loaded[name]):
            raise SystemExit(f"MISMATCH in {name}")
    return len(reference)


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(prefix="bcp-demo-"), "ckpt")
    print(f"bcp {bcp.__version__}: checkpoint at {path}")

    loss, stats, reference = run_ranks(2, save_phase, path)[0]
    nbytes = sum(t.numel() * t.element_size() for t in reference.values())
    print(f"[save]   2 processes, FSDP2: trained 5 steps (loss {loss:.4f}); saved model + AdamW, "
          f"{len(reference)} tensors, {nbytes / 1024:.1f} KiB in {sum(stats.seconds.values()) * 1000:.0f} ms")

    loaded, result, loss1 = resume_phase(0, 1, path)
    print(f"[resume] 1 process, plain module: {compare(reference, loaded)} tensors bitwise equal "
          f"(saved on {result.saved_world_size} ranks as {result.saved_framework!r}); 2 more steps, loss {loss1:.4f}")

    loaded, result, loss3 = run_ranks(3, resume_phase, path)[0]
    print(f"[resume] 3 processes, FSDP2: {compare(reference, loaded)} tensors bitwise equal; "
          f"2 more steps, loss {loss3:.4f}")
    print("demo OK: one checkpoint, three layouts, no conversion step")


if __name__ == "__main__":
    main()
