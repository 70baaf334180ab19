"""The order in which an epoch walks a map-style dataset, as a small record that rebuilds it.

Data-parallel ranks walk one global order per epoch (torch's ``DistributedSampler`` and Lightning's
wrapper of it deal its positions to the ranks, Accelerate deals its batches). A resume on another
number of ranks deals the positions not yet consumed again, so it needs that order, not only the
ranks' counts. The record (an *order spec*, a value of bcp's safe encoding) says how to rebuild it:

- ``{"kind": "sequence", "size": n}``: ``0 .. n-1`` (a sequential sampler, an unshuffled
  ``DistributedSampler``);
- ``{"kind": "permutation", "size": n, "seed": s}``: ``torch.randperm(n)`` of a generator seeded
  ``s`` (a shuffled ``DistributedSampler``: ``seed + epoch``; any sampler seeded per epoch);
- ``{"kind": "drawn", "size": n, "sampler": name, "generator": state}``: what a sampler of class
  ``name`` yields when its generator starts from ``state`` (a ``RandomSampler``: the state is the one
  recorded right before the epoch's draw, ``bcp.adapters.drawn_order``). It is rebuilt by iterating a
  live sampler of that class from that state, which also leaves its generator where the
  uninterrupted epoch left it;
- ``{"kind": "through", "outer": spec, "inner": spec}``: ``inner[outer[i]]`` (a distributed sampler
  over another sampler's indices, as Lightning's ``DistributedSamplerWrapper``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DistributedSampler, SequentialSampler

from bcp.adapters.distributed_sampler import ResumableDistributedSampler
from bcp.adapters.drawn_order import draws_its_order, drawn_from, redraw
from bcp.errors import MismatchError

_KEY = "dataloader"


def sequence(size: int) -> dict[str, Any]:
    return {"kind": "sequence", "size": int(size)}


def permutation(size: int, seed: int) -> dict[str, Any]:
    return {"kind": "permutation", "size": int(size), "seed": int(seed)}


def drawn(sampler: Any, state: torch.Tensor) -> dict[str, Any]:
    return {**drawing_shape(sampler), "generator": state.numpy().tobytes()}


def through(outer: dict[str, Any], inner: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "through", "outer": outer, "inner": inner}


def distributed(sampler: DistributedSampler, inner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The order a ``DistributedSampler`` deals in its current epoch (before its padding or cut):
    torch's ``randperm`` of ``seed + epoch`` when it shuffles; ``inner``: the order of the sampler
    whose indices it deals (a wrapper's), else the dataset's indices."""
    size = len(sampler.dataset)
    outer = permutation(size, sampler.seed + sampler.epoch) if sampler.shuffle else sequence(size)
    return outer if inner is None else through(outer, inner)


def of_sampler(sampler: Any, *, shape_only: bool = False) -> dict[str, Any] | None:
    """The spec of a sampler's current epoch, or None where bcp cannot rebuild it: a sequential
    sampler, a ``DistributedSampler`` of torch's own class, bcp's sampler walking its epoch from the
    start, or one drawing from a generator whose draw bcp followed (``shape_only``: the
    :func:`shape` of the spec, known before the draw)."""
    if type(sampler) is SequentialSampler:
        return sequence(len(sampler))
    if type(sampler) is DistributedSampler:
        return distributed(sampler)
    if isinstance(sampler, ResumableDistributedSampler):
        if sampler.start or sampler.resume_at:
            return None  # resumed by its own position: a walk of its own, not a class of the order
        return permutation(sampler.size, sampler.seed + sampler.epoch) if sampler.shuffle else sequence(sampler.size)
    if draws_its_order(sampler) and getattr(sampler, "replacement", False) is False \
            and len(sampler) == len(getattr(sampler, "data_source", ())):
        if shape_only:
            return drawing_shape(sampler)
        state = drawn_from(sampler)
        return None if state is None else drawn(sampler, state)
    return None


def size(spec: dict[str, Any]) -> int:
    """How many positions the order has."""
    return size(spec["outer"]) if spec["kind"] == "through" else int(spec["size"])


def draw_of(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The drawn part of an order, if any (what a live drawing sampler must rebuild)."""
    if spec["kind"] == "drawn":
        return spec
    if spec["kind"] == "through":
        return draw_of(spec["inner"]) or draw_of(spec["outer"])
    return None


def rebuild(spec: dict[str, Any], drawing_sampler: Any = None) -> list[int]:
    """The order ``spec`` describes, as dataset indices. A drawn part is rebuilt by
    ``drawing_sampler`` (a live sampler of the class that drew it, whose generator then stands where
    it stood after the saved draw)."""
    kind = spec["kind"]
    if kind == "sequence":
        return list(range(int(spec["size"])))
    if kind == "permutation":
        generator = torch.Generator()
        generator.manual_seed(int(spec["seed"]))
        return torch.randperm(int(spec["size"]), generator=generator).tolist()
    if kind == "through":
        inner = rebuild(spec["inner"], drawing_sampler)
        return [inner[i] for i in rebuild(spec["outer"], drawing_sampler)]
    if kind == "drawn":
        return _redraw(spec, drawing_sampler)
    raise MismatchError(f"the dataloader's position names an order of kind {kind!r}, unknown to this bcp", key=_KEY)


def _redraw(spec: dict[str, Any], sampler: Any) -> list[int]:
    if sampler is None or type(sampler).__qualname__ != spec["sampler"] or len(sampler) != int(spec["size"]):
        live = "none" if sampler is None else f"a {type(sampler).__qualname__} of {len(sampler)}"
        raise MismatchError(f"the epoch's order was drawn by a {spec['sampler']} of {spec['size']} samples from its "
                            f"generator, and the live loader has {live} to draw it again", key=_KEY)
    return redraw(sampler, generator_state(spec["generator"]))


def generator_state(saved: bytes) -> torch.Tensor:
    """A generator state saved as bytes, as ``torch.Generator.set_state`` takes it."""
    return torch.frombuffer(bytearray(saved), dtype=torch.uint8)


def shape(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The spec without the generator states of its drawn parts: which order a live sampler will walk,
    before it has drawn (compared with a saved spec's shape)."""
    if spec is None or spec["kind"] not in ("drawn", "through"):
        return spec
    if spec["kind"] == "drawn":
        return {k: v for k, v in spec.items() if k != "generator"}
    return through(shape(spec["outer"]), shape(spec["inner"]))


def drawing_shape(sampler: Any) -> dict[str, Any]:
    """The shape of the order a drawing sampler draws (its class and size)."""
    return {"kind": "drawn", "size": len(sampler), "sampler": type(sampler).__qualname__}


def same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two specs describe one order (drawn parts: the same sampler class and state)."""
    return a is not None and b is not None and a == b
