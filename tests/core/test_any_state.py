"""States beyond one model and one optimizer: an EMA copy, several models and optimizers under names
of the user's choosing, DTensors nested anywhere, pipeline model parts as a list. Every tensor is
resharded and replicated ones are written once, whatever their key (multi-process, gloo)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bcp
from models import MLP, assert_bitwise, build, full, model_state, rank, read_manifest, train


def _ema_update(ema: nn.Module, model: nn.Module) -> None:
    with torch.no_grad():
        for e, m in zip(ema.parameters(), model.parameters()):
            e.lerp_(m, 0.25)


def _with_ema(kind: str, seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    model, optimizer = build(kind, seed)
    torch.manual_seed(seed + 100)
    ema = MLP()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(ema)
    return model, ema, optimizer


def _optimizer_tensors(prefix: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    return {f"{prefix}/{names[id(p)]}/{key}": full(value).detach().clone()
            for group in optimizer.param_groups for p in group["params"]
            for key, value in optimizer.state.get(p, {}).items()}


def _whole(model: nn.Module, ema: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return (model_state(model) | {k.replace("model/", "ema/", 1): v for k, v in model_state(ema).items()}
            | _optimizer_tensors("optimizer", model, optimizer))


def save_with_ema(path: str) -> dict | None:
    model, ema, optimizer = _with_ema("fsdp2", seed=1)
    for step in range(3):
        train(model, optimizer, range(step, step + 1))
        _ema_update(ema, model)
    bcp.save(path, {"model": model, "optimizer": optimizer, "ema": ema})
    state = _whole(model, ema, optimizer)
    return state if rank() == 0 else None


def load_with_ema(kind: str, path: str) -> dict | None:
    model, ema, optimizer = _with_ema(kind, seed=2)
    bcp.load(path, {"model": model, "optimizer": optimizer, "ema": ema})
    state = _whole(model, ema, optimizer)
    return state if rank() == 0 else None


def _tensor_bytes(manifest) -> int:
    return sum(torch.Size(e.shape).numel() * torch.empty(0, dtype=getattr(torch, e.dtype)).element_size()
               for e in manifest.tensors.values())


def _data_bytes(path) -> int:
    generation = sorted(p for p in path.iterdir() if p.name.startswith("gen-"))[-1]
    return sum(f.stat().st_size for f in generation.rglob("*") if f.is_file() and "manifest" not in f.name
               and "table" not in f.name)


@pytest.mark.parametrize("world", [1, 3])
def test_fsdp2_model_ema_and_adamw_reshard_from_2_ranks(ranks, tmp_path, world):
    path = tmp_path / "ckpt"
    saved = ranks(2).run(save_with_ema, str(path))[0]
    manifest = read_manifest(path)
    assert {n.split("/", 1)[0] for n in manifest.tensors} == {"model", "optimizer", "ema"}
    # about model + EMA + optimizer on disk, not one copy per rank
    assert _data_bytes(path) < 1.1 * _tensor_bytes(manifest) + 4096
    loaded = [load_with_ema("plain", str(path))] if world == 1 else ranks(3).run(load_with_ema, "fsdp2", str(path))
    assert_bitwise(saved, loaded[0])


def _two_models(kind: str, seed: int) -> dict:
    student, opt_s = build(kind, seed)
    teacher, opt_t = build(kind, seed + 10)
    return {"nets": {"student": student, "teacher": teacher}, "opt_student": opt_s, "opt_teacher": opt_t}


def _two_models_whole(state: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, optimizer in (("student", state["opt_student"]), ("teacher", state["opt_teacher"])):
        model = state["nets"][name]
        out |= {f"{name}/{k}": v for k, v in model_state(model).items()}
        out |= _optimizer_tensors(f"{name}/opt", model, optimizer)
    return out


def save_two_models(kind: str, path: str) -> dict | None:
    state = _two_models(kind, seed=1)
    train(state["nets"]["student"], state["opt_student"], range(2))
    train(state["nets"]["teacher"], state["opt_teacher"], range(3))
    bcp.save(path, state)
    whole = _two_models_whole(state)
    return whole if rank() == 0 else None


def load_two_models(kind: str, path: str) -> dict | None:
    state = _two_models(kind, seed=5)
    bcp.load(path, state)
    whole = _two_models_whole(state)
    return whole if rank() == 0 else None


@pytest.mark.parametrize("src,dst,dst_world", [("ddp", "plain", 1), ("fsdp2", "fsdp2", 3)])
def test_two_models_with_two_optimizers_under_chosen_names(ranks, tmp_path, src, dst, dst_world):
    path = tmp_path / "ckpt"
    saved = ranks(2).run(save_two_models, src, str(path))[0]
    manifest = read_manifest(path)
    assert "nets/student/fc1.weight" in manifest.tensors and "opt_teacher/state/fc2.bias/exp_avg" in manifest.tensors
    if src == "ddp":  # replicated on both ranks, written by one
        assert all(len(entry.shards) == 1 for entry in manifest.tensors.values())
    # Whatever the layout, every element of every tensor is stored once (FSDP2: each parameter's and
    # moment's rows once, the replicated Adam steps by one rank), and the identical param groups of
    # both ranks are one record.
    for name, entry in manifest.tensors.items():
        assert sum(torch.Size(s.box.lengths).numel() for s in entry.shards) == torch.Size(entry.shape).numel(), name
    assert [len(manifest.objects[f"{o}/param_groups"].records) for o in ("opt_student", "opt_teacher")] == [1, 1]
    loaded = [load_two_models(dst, str(path))] if dst_world == 1 else ranks(dst_world).run(load_two_models, dst,
                                                                                            str(path))
    assert_bitwise(saved, loaded[0])


def _nested_dtensors(seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(7, 5, generator=g), torch.randn(3, 11, generator=g)
    return {"buffers": {"a": distribute_tensor(a, mesh, [Shard(0)]),
                        "deeper": [distribute_tensor(b, mesh, [Shard(1)])]},
            "note": f"rank {rank()}"}


def save_nested(path: str) -> None:
    bcp.save(path, {"anything": _nested_dtensors(seed=1)})


def load_nested(path: str) -> list:
    state = {"anything": _nested_dtensors(seed=2)}
    bcp.load(path, state)
    inner = state["anything"]
    return [inner["buffers"]["a"].full_tensor(), inner["buffers"]["deeper"][0].full_tensor(), inner["note"]]


def test_nested_dtensors_under_any_key_reshard_2_to_3(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_nested, path)
    assert {"anything/buffers/a", "anything/buffers/deeper/0"} <= set(read_manifest(path).tensors)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(7, 5, generator=g), torch.randn(3, 11, generator=g)
    for r, (got_a, got_b, note) in enumerate(ranks(3).run(load_nested, path)):
        assert torch.equal(got_a, a) and torch.equal(got_b, b)
        assert note == f"rank {r if r < 2 else 0}"


class Stack(nn.Module):
    """Four layers; a pipeline stage keeps some of them (torchtitan-style parts keep their names)."""

    def __init__(self, keep: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        every = [nn.Linear(6, 6) for _ in range(4)]
        self.layers = nn.ModuleDict({str(i): every[i] for i in keep})


def _parts(split: list[list[int]]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    parts = [Stack(keep) for keep in split]
    return parts, [torch.optim.Adam(p.parameters(), lr=0.1) for p in parts]


def _step(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], seed: int) -> None:
    for part, optimizer in zip(parts, optimizers):
        torch.manual_seed(seed)
        for p in part.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()


def _parts_whole(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    out = {}
    for part, optimizer in zip(parts, optimizers):
        names = {id(p): n for n, p in part.named_parameters()}
        out |= {n: p.detach().clone() for n, p in part.named_parameters()}
        for p, s in optimizer.state.items():
            out |= {f"{names[id(p)]}/{k}": v.clone() for k, v in s.items()}
    return out


STAGES_OF_2 = [[[0, 1]], [[2, 3]]]


def save_stage(path: str) -> dict:
    parts, optimizers = _parts(STAGES_OF_2[rank()])
    _step(parts, optimizers, seed=3)
    bcp.save(path, {"model": parts, "optimizer": optimizers})
    return _parts_whole(parts, optimizers)


def load_split(path: str, splits: list[list[list[int]]]) -> dict:
    """This rank's parts (``splits[rank]``: the layers of each part) with their optimizers, loaded strictly."""
    parts, optimizers = _parts(splits[rank()])
    bcp.load(path, {"model": parts, "optimizer": optimizers})
    return _parts_whole(parts, optimizers)


def _saved_stages(ranks, path: str) -> dict:
    saved = {}
    for stage in ranks(2).run(save_stage, path):
        saved |= stage
    return saved


def test_pipeline_parts_as_a_list_load_into_another_split(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _saved_stages(ranks, path)
    parts, optimizers = _parts([[0], [1, 2], [3]])  # one process, three parts: another split
    bcp.load(path, {"model": parts, "optimizer": optimizers})
    assert_bitwise(saved, _parts_whole(parts, optimizers))


@pytest.mark.parametrize("world,splits", [
    (3, [[[0]], [[1, 2]], [[3]]]),  # three stages of 1, 2 and 1 layers
    (2, [[[0], [3]], [[1], [2]]]),  # two ranks, two parts each, interleaved (a looped schedule)
])
def test_pipeline_parts_load_into_another_multi_rank_split(ranks, tmp_path, world, splits):
    path = str(tmp_path / "ckpt")
    saved = _saved_stages(ranks, path)
    loaded = {}
    for held in ranks(world).run(load_split, path, splits):
        assert not loaded.keys() & held.keys()
        loaded |= held
    assert_bitwise(saved, loaded)


def test_an_optimizer_over_a_module_and_its_submodule_needs_a_pairing(tmp_path):
    model, optimizer = build("plain", seed=1)
    state = {"model": model, "head": model.fc2, "optimizer": torch.optim.SGD(model.fc2.parameters(), lr=0.1)}
    with pytest.raises(bcp.AdapterError, match="PairedOptimizer"):
        bcp.save(str(tmp_path / "ckpt"), state)
    state["optimizer"] = bcp.PairedOptimizer(state["optimizer"], model.fc2)
    bcp.save(str(tmp_path / "ckpt"), state)
    assert "optimizer/param_groups" in read_manifest(tmp_path / "ckpt").objects


def test_a_misspelt_optimizer_key_is_still_an_optimizer(tmp_path):
    model, optimizer = build("plain", seed=1)
    train(model, optimizer, range(1))
    bcp.save(str(tmp_path / "ckpt"), {"model": model, "optimiser": optimizer})
    assert "optimiser/state/fc1.weight/exp_avg" in read_manifest(tmp_path / "ckpt").tensors
    fresh, fresh_optimizer = build("plain", seed=2)
    bcp.load(str(tmp_path / "ckpt"), {"model": fresh, "optimiser": fresh_optimizer})
    assert torch.equal(fresh_optimizer.state[fresh.fc1.weight]["exp_avg"], optimizer.state[model.fc1.weight]["exp_avg"])


def test_a_module_saved_as_a_per_rank_value_by_older_saves_still_loads(tmp_path):
    """Saves used to store every key but ``model``/``optimizer`` as the rank's own value (an EMA
    module as its ``state_dict()``); such checkpoints load into the module."""
    ema = MLP()
    bcp.save(str(tmp_path / "ckpt"), {"ema": ema.state_dict()})
    fresh = copy.deepcopy(ema)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    bcp.load(str(tmp_path / "ckpt"), {"ema": fresh})
    assert all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(), fresh.state_dict().values()))
