"""The state under test: GPT-like fp32 tensors of a chosen total size, and the layouts cut from it.

Shapes follow a GPT-2 block (fused qkv, 4x MLP, layer norms, biases) with ``LAYERS`` layers and a
vocabulary of ``VOCAB_PER_HIDDEN`` x hidden, so about 100 tensors of very different sizes whatever
the total. The hidden size is a multiple of 128: every 2-D tensor splits evenly over 2 ranks on
either dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch

LAYERS = 8
VOCAB_PER_HIDDEN = 16
POSITIONS = 1024
FLOATS_PER_HIDDEN_SQUARED = LAYERS * 12 + VOCAB_PER_HIDDEN  # the leading term of the parameter count


def gpt_shapes(total_bytes: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, fp32, totalling about ``total_bytes``."""
    hidden = max(128, round(math.sqrt(total_bytes / 4 / FLOATS_PER_HIDDEN_SQUARED) / 128) * 128)
    h = hidden
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (VOCAB_PER_HIDDEN * h, h), "wpe.weight": (POSITIONS, h)}
    for i in range(LAYERS):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
            p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,),
            p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
            p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
            p + "mlp.fc.weight": (4 * h, h), p + "mlp.fc.bias": (4 * h,),
            p + "mlp.proj.weight": (h, 4 * h), p + "mlp.proj.bias": (h,),
        })
    shapes.update({"ln_f.weight": (h,), "ln_f.bias": (h,)})
    return shapes


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def shapes_nbytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of fp32 tensors of these shapes."""
    return 4 * sum(math.prod(s) for s in shapes.values())


def random_tensor(shapes: dict[str, tuple[int, ...]], name: str, seed: int) -> torch.Tensor:
    """Tensor ``name`` of a random state, reproducible on its own (its generator is its own), so
    a process can rebuild any one global tensor without holding the whole state."""
    index = list(shapes).index(name)
    return torch.rand(shapes[name], generator=torch.Generator().manual_seed(seed * 1_000_003 + index))


def random_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Random values (every byte differs between tensors, so a misplaced byte range shows)."""
    return {name: random_tensor(shapes, name, seed) for name in shapes}


class Derived(Mapping[str, torch.Tensor]):
    """Tensors computed on access (``make(name)``), for checks that look at one at a time."""

    def __init__(self, names: list[str], make: Callable[[str], torch.Tensor]) -> None:
        self._names, self._make = names, make

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def zeros_in_one_block(shapes: dict[str, tuple[int, ...]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Zeroed destination tensors as views of one flat buffer (touched now, so no page faults are
    timed later); the flat buffer doubles as the destination of the raw-read floor."""
    flat = torch.zeros(sum(math.prod(s) for s in shapes.values()))
    views, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        views[name] = flat[at: at + n].view(shape)
        at += n
    return flat, views


def shard_dim(shape: tuple[int, ...], dim: int) -> int:
    """The dimension a tensor is cut on: ``dim`` where it exists, else the last one."""
    return min(dim, len(shape) - 1)


def local_shape(shape: tuple[int, ...], dim: int, world: int) -> tuple[int, ...]:
    d = shard_dim(shape, dim)
    return tuple(s // world if i == d else s for i, s in enumerate(shape))


def local_piece(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's even cut of ``tensor`` on ``dim`` (a view; contiguous for dim 0)."""
    return tensor.chunk(world, shard_dim(tuple(tensor.shape), dim))[rank]


def many_small(count: int, floats: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` tensors of ``floats`` fp32 values each: the per-tensor overhead workload."""
    generator = torch.Generator().manual_seed(seed)
    return {f"t{i:05d}": torch.rand(floats, generator=generator) for i in range(count)}
