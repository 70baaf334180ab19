"""``bcp inspect|verify|edit|convert|export`` with checkpoints at ``s3://`` (a real SeaweedFS) and
``memory://`` URLs: bcp checkpoints are read from and written to any storage; safetensors exports and
DCP folders, written as local files, must go to local folders, and a URL there is refused clearly."""

from __future__ import annotations

import uuid

import pytest
import torch
from safetensors.torch import load_file

from bcp.cli import main
from bcp.tools import open_checkpoint
from models import assert_bitwise
from tools_checkpoints import sharded_checkpoint


def read_all(url: str) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(url)
    return {name: checkpoint.read(name) for name in checkpoint.tensors}


def test_the_tools_read_and_write_checkpoints_at_urls(s3_env, s3_url, tmp_path, capsys):
    source = f"{s3_url}/source"
    tensors = sharded_checkpoint(source)
    assert main(["inspect", source]) == 0 and main(["verify", source]) == 0

    # edit: s3 -> s3, cast and drop
    edited = f"{s3_url}/edited"
    assert main(["edit", source, edited, "--drop", "model/positions", "--dtype", "model/embed.*=bfloat16"]) == 0
    expected = {n: t for n, t in tensors.items() if n != "model/positions"}
    expected["model/embed.weight"] = expected["model/embed.weight"].to(torch.bfloat16)
    assert_bitwise(expected, read_all(edited))
    assert open_checkpoint(edited).read_object("extra_state")["step"] == 7

    # bcp -> dcp (a local folder) -> bcp in memory://
    assert main(["convert", source, str(tmp_path / "dcp")]) == 0
    in_memory = f"memory://tools-{uuid.uuid4().hex[:8]}/ckpt"
    assert main(["convert", str(tmp_path / "dcp"), in_memory, "--trust-pickle"]) == 0  # our own DCP folder
    assert_bitwise(tensors, read_all(in_memory))

    # export from s3 to a local folder; and safetensors (hf) -> bcp on s3
    assert main(["export", source, "--to", "safetensors", str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    model_tensors = {n: t for n, t in tensors.items() if n.startswith("model/")}
    assert_bitwise({f"model/{n}": t for n, t in exported.items()}, model_tensors)
    from_hf = f"{s3_url}/from-hf"
    assert main(["convert", str(tmp_path / "hf"), from_hf]) == 0
    assert_bitwise(model_tensors, read_all(from_hf))
    capsys.readouterr()


@pytest.mark.parametrize("argv,message", [
    (["export", "{src}", "--to", "safetensors", "{url}/hf"],
     "safetensors exports are written to a local folder, got 's3://"),
    (["convert", "{src}", "{url}/dcp"], "DCP checkpoints are written to a local folder, got 's3://"),
    (["edit", "{src}", "{src}/inner"], "overlaps the source"),
    (["edit", "{src}", "{url}"], "overlaps the source"),
    (["edit", "{src}", "{url}/taken"], "is not empty; choose a new or empty folder"),
])
def test_outputs_the_tools_cannot_write_are_refused(s3_env, s3_url, argv, message, capsys):
    source = f"{s3_url}/source"
    sharded_checkpoint(source)
    sharded_checkpoint(f"{s3_url}/taken")
    assert main([a.format(src=source, url=s3_url) for a in argv]) == 1
    assert message in capsys.readouterr().err
