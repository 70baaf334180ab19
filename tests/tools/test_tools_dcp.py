"""PyTorch DCP <-> bcp: a DCP checkpoint saved by 2 FSDP2 ranks converts to bcp, loads from there
into live FSDP2 objects, and converts back to a DCP checkpoint with bitwise the same content."""

from __future__ import annotations

import os

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools import convert_bcp_to_dcp, convert_dcp_to_bcp, open_checkpoint
from models import assert_bitwise, build, full_state, rank, train


def save_dcp_from_fsdp2(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optimizer = build("fsdp2", seed=1)
    train(model, optimizer, range(3))
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
              "extra_state": {"step": 3, "tokens": [7, 8]}}, checkpoint_id=path)
    state = full_state(model, optimizer)  # collective: every rank gathers
    return state if rank() == 0 else None


def load_into_fsdp2(path: str) -> dict:
    model, optimizer = build("fsdp2", seed=2)
    state = {"model": model, "optimizer": optimizer, "extra_state": None}
    bcp.load(path, state)
    loaded = full_state(model, optimizer)  # collective: every rank gathers
    return {"state": loaded if rank() == 0 else None, "extra": state["extra_state"],
            "betas": optimizer.param_groups[0]["betas"]}


@pytest.fixture(scope="module")
def dcp_checkpoint(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    saved = ranks(2).run(save_dcp_from_fsdp2, path)[0]
    return path, saved


def test_dcp_to_bcp_loads_into_fsdp2_bitwise(ranks, tmp_path, dcp_checkpoint):
    source, saved = dcp_checkpoint
    out = str(tmp_path / "bcp")

    assert main(["convert", "--from", "dcp", source, out, "--trust-pickle"]) == 0

    results = ranks(2).run(load_into_fsdp2, out)
    assert_bitwise(saved, results[0]["state"])
    for result in results:
        assert result["extra"] == {"step": 3, "tokens": [7, 8]}
        assert tuple(result["betas"]) == (0.9, 0.999)


def test_dcp_to_bcp_to_dcp_is_bitwise(tmp_path, dcp_checkpoint):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source, _ = dcp_checkpoint
    middle, back = str(tmp_path / "bcp"), str(tmp_path / "dcp")
    convert_dcp_to_bcp(source, middle, trust_pickle=True)
    convert_bcp_to_dcp(middle, back)

    before, after = FileSystemReader(source).read_metadata(), FileSystemReader(back).read_metadata()
    assert before.state_dict_metadata.keys() == after.state_dict_metadata.keys()
    dcp_to_torch_save(source, tmp_path / "before.pt")
    dcp_to_torch_save(back, tmp_path / "after.pt")
    assert_same_tree(torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_state_dict_becomes_the_model_component(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, _ = build("plain", seed=4)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert_dcp_to_bcp(tmp_path / "dcp", tmp_path / "bcp", trust_pickle=True)

    fresh, _ = build("plain", seed=5)
    bcp.load(str(tmp_path / "bcp"), {"model": fresh})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_reading_dcp_needs_the_trust_flag(tmp_path, dcp_checkpoint, capsys):
    source, _ = dcp_checkpoint
    with pytest.raises(bcp.UnsafeCheckpointError, match="pickle"):
        convert_dcp_to_bcp(source, tmp_path / "out")
    assert main(["convert", source, str(tmp_path / "out")]) == 1  # the format is detected; trust is not assumed
    assert "--trust-pickle" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_damaged_dcp_input_fails_clearly_and_leaves_no_output(tmp_path, dcp_checkpoint):
    import shutil

    source, _ = dcp_checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    os.unlink(broken / sorted(n for n in os.listdir(broken) if n.endswith(".distcp"))[0])
    with pytest.raises(bcp.CorruptCheckpointError, match="reading"):
        convert_dcp_to_bcp(broken, tmp_path / "out", trust_pickle=True)
    assert not os.listdir(tmp_path / "out")  # the uncommitted generation was removed

    (broken / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(bcp.CorruptCheckpointError, match="unreadable DCP metadata"):
        convert_dcp_to_bcp(broken, tmp_path / "out2", trust_pickle=True)
    with pytest.raises(bcp.CheckpointNotFoundError, match="no .metadata"):
        convert_dcp_to_bcp(tmp_path / "missing", tmp_path / "out3", trust_pickle=True)


class Opaque:
    """A value outside bcp's safe encoding: it can only be stored pickled."""


def test_bcp_to_dcp_unpickles_only_when_allowed(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    bcp.save(str(tmp_path / "ckpt"), {"model": {"w": torch.ones(2)}, "extra": Opaque()}, allow_pickle=True)
    with pytest.raises(bcp.UnsafeCheckpointError):
        convert_bcp_to_dcp(tmp_path / "ckpt", tmp_path / "dcp")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "dcp2"), "--trust-pickle"]) == 0
    assert set(FileSystemReader(str(tmp_path / "dcp2")).read_metadata().state_dict_metadata) == {"model.w", "extra"}


def assert_same_tree(a, b, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    else:
        assert a == b, where


def _any_state(seed: int) -> dict:
    """An FSDP2 model with AdamW, an FSDP2 EMA copy and a DTensor nested in dicts, with a plain value beside it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from models import MLP

    model, optimizer = build("fsdp2", seed=seed)
    torch.manual_seed(seed + 100)
    ema = MLP()
    fully_shard(ema)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    table = torch.randn(7, 5, generator=torch.Generator().manual_seed(seed))
    return {"model": model, "optimizer": optimizer, "ema": ema,
            "extra": {"table": distribute_tensor(table, mesh, [Shard(0)]), "epoch": seed}}


def _whole_any_state(state: dict) -> dict:
    from models import full

    whole = {f"model+optimizer/{k}": v for k, v in full_state(state["model"], state["optimizer"]).items()}
    whole |= {f"ema/{k}": full(v).detach().clone() for k, v in state["ema"].state_dict().items()}
    whole["extra/table"] = state["extra"]["table"].full_tensor()
    return whole


def save_dcp_any_state(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = _any_state(seed=1)
    train(state["model"], state["optimizer"], range(2))
    dcp.save({"model": get_model_state_dict(state["model"]),
              "optimizer": get_optimizer_state_dict(state["model"], state["optimizer"]),
              "ema": get_model_state_dict(state["ema"]), "extra": state["extra"]}, checkpoint_id=path)
    whole = _whole_any_state(state)
    return whole if rank() == 0 else None


def load_any_state(path: str) -> dict:
    state = _any_state(seed=2)
    bcp.load(path, state)
    whole = _whole_any_state(state)
    return {"state": whole if rank() == 0 else None, "epoch": state["extra"]["epoch"]}


def test_every_dcp_tensor_is_resharded_whatever_its_key(ranks, tmp_path):
    """Guards a defect: only tensors under ``model`` and ``optimizer`` became resharded entries;
    an EMA module's state dict or a DTensor under another key became part of a per-rank value, which
    a load into live modules and DTensors on another number of ranks refused."""
    source, out = str(tmp_path / "dcp"), str(tmp_path / "bcp")
    saved = ranks(2).run(save_dcp_any_state, source)[0]
    convert_dcp_to_bcp(source, out, trust_pickle=True)
    tensors = set(open_checkpoint(out).manifest.tensors)
    assert {"ema/fc1.weight", "extra/table"} <= tensors
    results = ranks(3).run(load_any_state, out)
    assert_bitwise(saved, results[0]["state"])
    assert [r["epoch"] for r in results] == [1, 1, 1]


def test_dcp_paths_name_entries_as_bcp_save_names_a_state():
    from bcp.tools.convert_dcp import bcp_name, holding_tensors, optimizer_keys

    tensors = [("ema", "fc1.weight"), ("opt", "state", "fc1.weight", "exp_avg"), ("extra", "deep", 0, "t")]
    paths = [*tensors, ("opt", "param_groups", 0, "lr"), ("opt", "state", "fc1.weight", "step"),
             ("extra", "epoch"), ("extra", "deep", 1, "note"), ("extra", "cfg", "a"), ("run", "seed")]
    optimizers, holding = optimizer_keys(paths), holding_tensors(tensors)
    named = {path: bcp_name(path, is_tensor=path in tensors, optimizers=optimizers, holding=holding)
             for path in paths}
    assert named == {
        ("ema", "fc1.weight"): ("ema/fc1.weight", ()),
        ("opt", "state", "fc1.weight", "exp_avg"): ("opt/state/fc1.weight/exp_avg", ()),
        ("extra", "deep", 0, "t"): ("extra/deep/0/t", ()),
        ("opt", "param_groups", 0, "lr"): ("opt/param_groups", (0, "lr")),
        ("opt", "state", "fc1.weight", "step"): ("opt/state/fc1.weight/step", ()),
        ("extra", "epoch"): ("extra/epoch", ()),  # beside a tensor: a value of its own, as bcp.save walks it
        ("extra", "deep", 1, "note"): ("extra/deep/1", ("note",)),
        ("extra", "cfg", "a"): ("extra/cfg", ("a",)),  # a dict holding no tensor: one value
        ("run", "seed"): ("run", ("seed",)),
    }
