"""``bcp edit``: a new committed checkpoint with entries renamed, dropped or cast; the source is
never modified, shards and per-rank values are kept, and a failure leaves no checkpoint behind."""

from __future__ import annotations

import os

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools import CastRules, NameRules, edit_checkpoint, open_checkpoint
from tools_checkpoints import flip_byte, sharded_checkpoint, tree_digest
from models import build, rank, train


def test_edit_renames_drops_and_casts_without_touching_the_source(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    tensors = sharded_checkpoint(src)
    before = tree_digest(src)

    assert main(["edit", src, out, "--drop", "model/flat.*", "--rename", r"^model/embed\.", "model/tokens.",
                 "--dtype", "model/grid.*=bfloat16"]) == 0

    assert tree_digest(src) == before
    edited, original = open_checkpoint(out), open_checkpoint(src)
    assert sorted(edited.tensors) == sorted({n.replace("model/embed.", "model/tokens.") for n in tensors}
                                            - {"model/flat.weight"})
    assert torch.equal(edited.read("model/tokens.weight"), tensors["model/embed.weight"])
    assert torch.equal(edited.read("model/grid.weight"), tensors["model/grid.weight"].to(torch.bfloat16))
    assert [s.box for s in edited.tensors["model/grid.weight"].shards] == \
        [s.box for s in original.tensors["model/grid.weight"].shards]  # shards kept as saved
    assert edited.read_object("extra_state")["step"] == 7 and edited.read_object("model/note")
    assert main(["verify", out]) == 0


def test_consolidate_stores_every_tensor_whole(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    tensors = sharded_checkpoint(src)

    result = edit_checkpoint(src, out, consolidate=True)

    edited = open_checkpoint(out)
    assert result.tensors == len(tensors) and result.dropped == 0
    for name, tensor in tensors.items():
        assert len(edited.tensors[name].shards) == 1 and torch.equal(edited.read(name), tensor)


def test_a_model_loads_from_its_cast_copy(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    model, optimizer = build("plain", seed=1)
    train(model, optimizer, range(2))
    bcp.save(src, {"model": model, "optimizer": optimizer})

    edit_checkpoint(src, out, rules=NameRules(drop=("optimizer/*",)), casts=CastRules.parse(["bfloat16"]))

    fresh, _ = build("plain", seed=2)
    fresh.to(torch.bfloat16)
    bcp.load(out, {"model": fresh})
    for (name, value), loaded in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(loaded, value.to(torch.bfloat16)), name


def save_per_rank(path: str) -> None:
    model, optimizer = build("fsdp2", seed=1)
    bcp.save(path, {"model": model, "extra_state": {"rank": rank()}})


def load_per_rank(path: str) -> dict:
    model, _ = build("fsdp2", seed=3)
    state = {"model": model, "extra_state": None}
    bcp.load(path, state)
    return state["extra_state"]


def load_error(path: str) -> str:
    try:
        load_per_rank(path)
    except bcp.MismatchError as exc:
        return str(exc)
    return ""


def test_per_rank_values_and_shards_survive_an_edit(ranks, tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    ranks(2).run(save_per_rank, src)

    edit_checkpoint(src, out, casts=CastRules.parse(["float64"]))

    edited = open_checkpoint(out)
    assert edited.manifest.world_size == 2 and edited.manifest.framework == "fsdp2"
    assert len(edited.tensors["model/fc1.weight"].shards) == 2
    errors = ranks(2).run(load_error, out)  # the live model is still float32
    assert all("dtype mismatch: checkpoint has float64, the live tensor is float32" in e for e in errors)
    edit_checkpoint(out, tmp_path / "back", casts=CastRules.parse(["float32"]))
    assert ranks(2).run(load_per_rank, str(tmp_path / "back")) == [{"rank": 0}, {"rank": 1}]


def test_refusals_and_failures_leave_nothing_behind(tmp_path, capsys):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    sharded_checkpoint(src)

    assert main(["edit", src, src]) == 1
    assert "overlaps the source" in capsys.readouterr().err
    assert main(["edit", src, os.path.join(src, "gen-00000001", "copy")]) == 1
    assert "overlaps the source" in capsys.readouterr().err
    os.makedirs(tmp_path / "busy")
    (tmp_path / "busy" / "keep.txt").write_text("x")
    assert main(["edit", src, str(tmp_path / "busy")]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert main(["edit", src, out, "--rename", "^model/.*$", "model/x"]) == 1
    assert "the same name 'model/x'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage_error:
        main(["edit", src, out, "--dtype", "int8"])
    assert usage_error.value.code == 2 and "only floating-point dtypes" in capsys.readouterr().err

    flip_byte(src, "model/grid.weight", shard=3)  # damage the source: the edit must fail cleanly
    assert main(["edit", src, out]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert not os.path.exists(out) or os.listdir(out) == []


def test_tied_entries_still_share_their_bytes(tmp_path):
    from safetensors.torch import save_file

    from bcp.tools import convert_hf_to_bcp

    save_file({"embed": torch.randn(4, 2)}, str(tmp_path / "w.safetensors"))
    convert_hf_to_bcp(tmp_path / "w.safetensors", tmp_path / "src", ties={"head": "embed"})

    edit_checkpoint(tmp_path / "src", tmp_path / "out", casts=CastRules.parse(["float16"]))

    edited = open_checkpoint(tmp_path / "out")
    assert edited.tensors["model/head"].shards == edited.tensors["model/embed"].shards
    assert edited.manifest.total_tensor_bytes() == 2 * (4 * 2 * 2)  # two entries, one copy of the bytes each
