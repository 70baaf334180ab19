"""``LoadResult`` says what was and was not loaded on both sides, as torch's
``load_state_dict(strict=False)`` lists ``missing_keys`` and ``unexpected_keys``: ``loaded`` (the
saved names this rank loaded), ``missing`` (asked for, not saved) and ``unexpected`` (saved, loaded
by no rank: whole components the state does not name included, the same on every rank).

Guards a past defect: after a ``strict=False`` load whose state misspelt ``optimizer``,
``unexpected`` was empty while the whole saved optimizer was left in the checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist

import bcp
import bcp.integration
from models import build


def _saved(path: str) -> tuple[list[str], list[str]]:
    model, optimizer = build("plain", seed=1)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()  # state for every parameter
    bcp.save(path, {"model": model, "optimizer": optimizer, "ema": {"w": torch.ones(3)}})
    checkpoint = bcp.integration.open_checkpoint(path)
    names = sorted([*checkpoint.tensors, *checkpoint.objects])
    return [n for n in names if n.startswith("model/")], [n for n in names if not n.startswith("model/")]


def test_a_misspelt_optimizer_is_missing_and_the_saved_one_unexpected(tmp_path):
    model_names, others = _saved(str(tmp_path))
    model, optimizer = build("plain", seed=2)
    result = bcp.load(tmp_path, {"model": model, "optimiser": optimizer}, strict=False)
    assert sorted(result.loaded) == model_names
    assert result.missing and all(name.startswith("optimiser/") for name in result.missing)
    assert result.unexpected == others and "ema/w" in others and "optimizer/param_groups" in others
    assert optimizer.state_dict()["state"] == {}  # not loaded, not touched


def test_names_left_in_a_requested_component_are_unexpected(tmp_path):
    model_names, others = _saved(str(tmp_path))
    model, _ = build("plain", seed=2)
    live = {k: v for k, v in model.state_dict().items() if k != "fc2.bias"}
    result = bcp.load(tmp_path, {"model": live}, strict=False)
    assert result.missing == [] and result.unexpected == sorted(["model/fc2.bias", *others])


def rank_wants_its_own_half(path: str) -> tuple[list[str], list[str]]:
    """Each rank asks for half of the model's names (as pipeline stages do): nothing of the model
    is unexpected, the other components are, on both ranks."""
    model, _ = build("plain", seed=2)
    names = sorted(model.state_dict())
    mine = {k: v for i, (k, v) in enumerate(sorted(model.state_dict().items())) if i % 2 == dist.get_rank()}
    result = bcp.load(path, {"model": mine})
    assert len(names) >= 2
    return result.loaded, result.unexpected


def test_ranks_asking_for_different_names_agree_on_the_unexpected(ranks, tmp_path):
    ranks(2).run(_save_on_ranks, str(tmp_path))
    (loaded0, unexpected0), (loaded1, unexpected1) = ranks(2).run(rank_wants_its_own_half, str(tmp_path))
    assert loaded0 and loaded1 and not set(loaded0) & set(loaded1)
    assert unexpected0 == unexpected1 and unexpected0 and not any(n.startswith("model/") for n in unexpected0)


def _save_on_ranks(path: str) -> None:
    _saved(path)
