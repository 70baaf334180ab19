"""States with trained weights, for the compression cases: an MLP trained in the benchmark (to fit a
fixed synthetic data set, AdamW on fp32 master weights) until its weights have left their initial
distribution, and two checkpoints of it: its weights in bf16, and a mixed-precision
training checkpoint (bf16 weights, fp32 master weights, AdamW's two fp32 moments).

Nothing is cached: the model is trained anew in each run (a few seconds to a minute on one core)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

Tensors = dict[str, torch.Tensor]
BF16, MIXED = "bf16 weights", "mixed-precision checkpoint"  # the latter: bf16 and fp32 weights, AdamW moments
KS_SAMPLE = 1 << 16  # values per matrix compared with its initial ones: a KS distance to ~0.005
PARTS = ("weights", "master", "exp_avg", "exp_avg_sq")  # the mixed-precision state's, by name prefix
BATCHES = 8  # the data set: this many batches, cycled (fresh random batches taught the MLP little)


@dataclass
class Trained:
    states: dict[str, Tensors]  # BF16 and MIXED
    figures: dict[str, float]  # what training did: steps, losses, how far the weights moved


def train(width: int, layers: int, steps: int, batch: int, lr: float, seed: int = 0) -> Trained:
    """An MLP of ``layers`` blocks (LayerNorm, Linear(width, width), GELU) and an output Linear,
    trained ``steps`` steps of AdamW (learning rate ``lr``, weight decay 0.1) to reproduce a 2-layer
    random teacher's outputs on ``BATCHES`` fixed batches of random inputs."""
    torch.manual_seed(seed)
    blocks = [m for _ in range(layers) for m in (nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())]
    model = nn.Sequential(*blocks, nn.Linear(width, width))
    teacher = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)).requires_grad_(False)
    nn.init.normal_(teacher[0].weight, std=2 / width**0.5)  # tanh's inputs of about unit variance
    inputs = torch.randn(BATCHES, batch, width)
    targets = teacher(inputs)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, started = [], time.perf_counter()
    for step in range(steps):
        loss = nn.functional.mse_loss(model(inputs[step % BATCHES]), targets[step % BATCHES])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    figures = {"steps": steps, "seconds": time.perf_counter() - started, "first_loss": losses[0],
               "last_loss": sum(losses[-BATCHES:]) / len(losses[-BATCHES:]), **_drift(model, initial)}
    return Trained(_checkpoints(model, optimizer), figures)


def part_of(name: str) -> str:
    """The part of a state a tensor belongs to: its name's prefix in the mixed-precision state, and
    ``weights`` for the bf16 weights' bare parameter names."""
    prefix = name.split(".", 1)[0]
    return prefix if prefix in PARTS else PARTS[0]


def _checkpoints(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensors]:
    master = {n: p.detach() for n, p in model.named_parameters()}
    weights = {n: p.to(torch.bfloat16) for n, p in master.items()}
    mixed = {f"weights.{n}": t for n, t in weights.items()}
    mixed.update({f"master.{n}": t for n, t in master.items()})
    for n, p in model.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            mixed[f"{moment}.{n}"] = optimizer.state[p][moment]
    return {BF16: weights, MIXED: mixed}


def _drift(model: nn.Module, initial: Tensors) -> dict[str, float]:
    """How far the weight matrices moved from their initialisation, medians over matrices: the norm
    of the change relative to the initial norm, and the Kolmogorov-Smirnov distance between the
    distributions of their values now and at initialisation (0: the same distribution)."""
    changes, distances = [], []
    for name, p in model.named_parameters():
        if p.dim() == 2:
            before = initial[name]
            changes.append(((p.detach() - before).norm() / before.norm()).item())
            distances.append(ks_distance(p.detach().flatten(), before.flatten()))
    return {"relative_change": _median(changes), "ks_distance": _median(distances)}


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The two-sample Kolmogorov-Smirnov statistic on the first ``KS_SAMPLE`` values of each."""
    a, b = a[:KS_SAMPLE].double().sort().values, b[:KS_SAMPLE].double().sort().values
    grid = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, grid, right=True) / a.numel()
    cdf_b = torch.searchsorted(b, grid, right=True) / b.numel()
    return (cdf_a - cdf_b).abs().max().item()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
