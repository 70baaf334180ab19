"""The tools see tensors held outside modules (an EMA kept as a plain dict of tensors) as the
tensors they are: listed, read, exported to safetensors and edited like a model's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import torch as safetensors_torch
from torch import nn

import bcp
from bcp.cli import main
from bcp.tools import open_checkpoint, read_tensor
from models import assert_bitwise


def ema_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """A model with its EMA held as a plain dict of tensors (plus a non-tensor leaf); returns the EMA."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    ema = {name: value.detach().clone() + 1 for name, value in model.state_dict().items()}
    bcp.save(path, {"model": model, "ema": {**ema, "decay": 0.999}})
    return ema


def test_inspect_lists_the_tensors_of_a_plain_dict(tmp_path, capsys):
    ema = ema_checkpoint(str(tmp_path))
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["components"]["ema"] == {"tensors": len(ema), "values": 1}
    rows = {row["name"]: row for row in summary["tensors"]}
    assert rows["ema/0.weight"]["shape"] == [4, 6] and rows["ema/0.weight"]["dtype"] == "float32"


def test_read_tensor_reads_one_tensor_of_a_plain_dict_or_a_slice_of_it(tmp_path):
    ema = ema_checkpoint(str(tmp_path))
    assert torch.equal(read_tensor(tmp_path, "ema/1.weight"), ema["1.weight"])
    assert torch.equal(read_tensor(tmp_path, "ema/0.weight", (slice(1, 3),)), ema["0.weight"][1:3])


def test_an_ema_held_in_a_plain_dict_exports_to_safetensors(tmp_path, capsys):
    ema = ema_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), "--component", "ema", "--to", "safetensors", str(out)]) == 0
    exported = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    assert_bitwise(ema, exported)
    reloaded = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    reloaded.load_state_dict(exported)  # the EMA weights as a model, ready for from_pretrained-style use


def test_edit_casts_and_drops_the_tensors_of_a_plain_dict(tmp_path):
    ema = ema_checkpoint(str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    assert main(["edit", str(tmp_path / "ckpt"), out, "--dtype", "ema/*=bfloat16"]) == 0
    edited = open_checkpoint(out)
    assert edited.tensors["ema/0.weight"].dtype == "bfloat16"
    assert torch.equal(edited.read("ema/0.weight"), ema["0.weight"].to(torch.bfloat16))
    assert edited.read_object("ema")["decay"] == 0.999
    assert main(["verify", out]) == 0
    live = {"ema": {name: torch.zeros_like(value, dtype=torch.bfloat16) for name, value in ema.items()}}
    bcp.load(out, live, strict=False)
    assert torch.equal(live["ema"]["1.bias"], ema["1.bias"].to(torch.bfloat16))

    dropped = str(tmp_path / "dropped")
    assert main(["edit", str(tmp_path / "ckpt"), dropped, "--drop", "ema"]) == 0  # its tensors go with it
    assert not [name for name in open_checkpoint(dropped).tensors if name.startswith("ema/")]


def test_edit_refuses_to_drop_a_tensor_apart_from_the_value_holding_it(tmp_path):
    ema_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(bcp.MismatchError, match="'ema/0.bias' would be dropped apart from the value 'ema'"):
        bcp.tools.edit_checkpoint(tmp_path / "ckpt", tmp_path / "out",
                                  rules=bcp.tools.NameRules(drop=("ema/0.bias",)))
