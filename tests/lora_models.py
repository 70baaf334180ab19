"""A fine-tuning state for incremental saves: a frozen base (linear layers whose weights span more
than one 1 MiB checksum chunk) with low-rank adapters, AdamW over the adapters only."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import bcp
from models import assert_bitwise, full_state, rank, train


class LoraMLP(nn.Module):
    """``base*`` are frozen; ``down*``/``up*`` are the trainable adapters. 640 is split unevenly by 3."""

    def __init__(self) -> None:
        super().__init__()
        self.base1 = nn.Linear(12, 640)
        self.base2 = nn.Linear(640, 640)  # 1.6 MB: two checksum chunks
        self.base3 = nn.Linear(640, 7)
        self.down = nn.Linear(640, 4, bias=False)
        self.up = nn.Linear(4, 640, bias=False)
        for layer in (self.base1, self.base2, self.base3):
            layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.base1(x))
        h = torch.relu(self.base2(h) + self.up(self.down(h)))
        return self.base3(h)


def build_lora(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LoraMLP()
    nn.init.normal_(model.up.weight, std=0.02)  # LoRA's up-projection starts at zero; here it trains visibly
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif kind != "plain":
        raise ValueError(kind)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def frozen_nbytes(model: nn.Module) -> int:
    """Bytes of the whole frozen base (every rank's shards)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


SAVES = 3


def save_fine_tuning(kind: str, path: Any, async_save: bool, env: dict[str, str] | None = None) -> list[dict]:
    """Three incremental saves of a frozen base + adapters, training the adapters in between (``env``:
    variables the rank processes, started before a test's server, need to reach it)."""
    os.environ.update(env or {})
    model, optimizer = build_lora(kind, seed=1)
    out = []
    for save in range(SAVES):
        train(model, optimizer, range(2 * save, 2 * save + 2))
        handle = bcp.save(path, {"model": model, "optimizer": optimizer, "extra_state": {"save": save}},
                          incremental=True, keep_generations=SAVES, async_save=async_save)
        handle.wait()
        state = full_state(model, optimizer)
        out.append({"generation": handle.generation, "written": handle.stats.bytes,
                    "reused": handle.stats.reused_bytes, "state": state if rank() == 0 else None,
                    "frozen": frozen_nbytes(model)})
    return out


def load_generation(kind: str, path: Any, generation: int | None, env: dict[str, str] | None = None) -> dict:
    os.environ.update(env or {})
    model, optimizer = build_lora(kind, seed=2)
    train(model, optimizer, range(1))  # live optimizer state to be replaced
    state = {"model": model, "optimizer": optimizer, "extra_state": None}
    result = bcp.load(path, state, generation=generation)
    loaded = full_state(model, optimizer)  # collective
    return {"state": loaded if rank() == 0 else None, "extra": state["extra_state"], "generation": result.generation}


def assert_round_trip(ranks: Any, path: Any, saves: list[list[dict]], env: dict[str, str] | None = None,
                      generations: bool = True) -> None:
    """``saves`` (every rank's :func:`save_fine_tuning`) wrote the adapters and not the base after the
    first save, and each kept generation (the newest only, without ``generations``) loads bitwise on
    one rank and on three (``path``: the checkpoint, or for a target that depends on the world
    size, a function of it)."""
    frozen = saves[0][0]["frozen"]
    for save in range(SAVES):
        written = sum(rank_saves[save]["written"] for rank_saves in saves)
        reused = sum(rank_saves[save]["reused"] for rank_saves in saves)
        if save == 0:
            assert reused == 0 and written > frozen
        else:  # the adapters and their optimizer state are written, the frozen base is not
            assert reused >= frozen and written < frozen / 10, (save, written, reused)
    for save in range(SAVES) if generations else [SAVES - 1]:
        generation = saves[0][save]["generation"] if generations else None
        expected = saves[0][save]["state"]
        alone = load_generation("plain", path(1) if callable(path) else path, generation, env)
        assert alone["extra"] == {"save": save}
        assert_bitwise(expected, alone["state"])
        on_three = ranks(3).run(load_generation, "fsdp2", path(3) if callable(path) else path, generation, env)
        assert_bitwise(expected, on_three[0]["state"])
        assert [r["extra"] for r in on_three] == [{"save": save}] * 3
