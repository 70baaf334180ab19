"""``bcp export --to safetensors``: files the safetensors library reads bitwise, split by size,
cast, renamed; clear refusals; and memory bounded by the largest tensor, not the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import bcp
from bcp.cli import main
from bcp.tools import export_safetensors
from tools_checkpoints import flip_byte, sharded_checkpoint, tree_digest

safetensors_torch = pytest.importorskip("safetensors.torch")


def load_folder(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(os.path.join(folder, name)))
    return out


def _model_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in tensors.items() if name.startswith("model/")}


def test_export_is_bitwise_and_leaves_the_checkpoint_alone(tmp_path, capsys):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    tensors = _model_tensors(sharded_checkpoint(ckpt))
    before = tree_digest(ckpt)

    assert main(["export", ckpt, "--to", "safetensors", out]) == 0

    assert os.listdir(out) == ["model.safetensors"]
    exported = load_folder(out)
    assert exported.keys() == {name.removeprefix("model/") for name in tensors}
    for name, tensor in tensors.items():
        assert torch.equal(exported[name.removeprefix("model/")], tensor), name
    assert "not exported (non-tensor values): model/note" in capsys.readouterr().out
    assert tree_digest(ckpt) == before


def test_export_splits_files_with_an_index(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    tensors = _model_tensors(sharded_checkpoint(ckpt))

    result = export_safetensors(ckpt, out, max_shard_size=250)

    # 240 | 192 | 60 + 12 + 96 + 4 bytes: consecutive tensors while they fit in 250 bytes
    assert result.files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"].values()) == set(result.files)
    for name, file in index["weight_map"].items():
        assert name in safetensors_torch.load_file(os.path.join(out, file))
    assert load_folder(out).keys() == index["weight_map"].keys()


def test_export_casts_renames_and_drops(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    tensors = sharded_checkpoint(ckpt)

    assert main(["export", ckpt, "--to", "safetensors", out, "--dtype", "bf16", "--dtype", "grid.*=float16",
                 "--drop", "flat.*", "--rename", r"^(\w+)\.weight$", r"layers.\1.w"]) == 0

    exported = load_folder(out)
    assert sorted(exported) == ["layers.embed.w", "layers.grid.w", "layers.norm.w", "positions", "scale"]
    assert torch.equal(exported["layers.embed.w"], tensors["model/embed.weight"].to(torch.bfloat16))
    assert torch.equal(exported["layers.grid.w"], tensors["model/grid.weight"].to(torch.float16))
    assert torch.equal(exported["positions"], tensors["model/positions"])  # integers are never cast


def test_export_other_components_and_refusals(tmp_path, capsys):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    bcp.save(ckpt, {"model": model, "optimizer": optimizer})

    export_safetensors(ckpt, out, component="optimizer")
    assert sorted(load_folder(out)) == ["state/bias/momentum_buffer", "state/weight/momentum_buffer"]

    assert main(["export", ckpt, "--to", "safetensors", out]) == 1
    assert "already holds ['model.safetensors']; pass overwrite (--overwrite)" in capsys.readouterr().err
    assert main(["export", ckpt, "--to", "safetensors", out, "--overwrite"]) == 0
    assert sorted(load_folder(out)) == ["bias", "weight"]

    assert main(["export", ckpt, "--to", "safetensors", str(tmp_path / "x"), "--component", "extra"]) == 1
    assert "component 'extra' holds no tensors; components: ['model', 'optimizer']" in capsys.readouterr().err
    assert main(["export", ckpt, "--to", "safetensors", str(tmp_path / "x"), "--rename", "^.*$", "same"]) == 1
    assert "the same name 'same'" in capsys.readouterr().err
    assert main(["export", ckpt, "--to", "safetensors", os.path.join(ckpt, "inside")]) == 1
    assert "overlaps the source" in capsys.readouterr().err


def test_a_corrupted_checkpoint_fails_the_export_and_leaves_no_file(tmp_path, capsys):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    sharded_checkpoint(ckpt)
    file = flip_byte(ckpt, "model/positions")

    assert main(["export", ckpt, "--to", "safetensors", out]) == 1

    assert f"checksum mismatch in {file}" in capsys.readouterr().err
    assert os.listdir(out) == []  # the partial file was removed


def test_export_refuses_to_drop_ties_the_checkpoint_does_not_hold(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tools_hf_models import llama

    model = llama(seed=0)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 1)  # untied, unlike the config
    bcp.save(str(tmp_path / "ckpt"), {"model": model})
    model.config.save_pretrained(tmp_path / "config")
    with pytest.raises(bcp.MismatchError, match="ties 'lm_head.weight' to 'model.embed_tokens.weight'"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf", config=tmp_path / "config")
    assert transformers is not None


MEASURE = r"""
import os, sys, torch
from bcp.tools import convert_hf_to_bcp, export_safetensors

def hwm_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

def peak_bytes(run):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one
    start = rss_kib()
    run()
    return (hwm_kib() - start) * 1024

ckpt, out, tiny, back = sys.argv[1:5]
export_safetensors(tiny, out + "-warmup")  # first use loads code; keep it out of the measurement
print(peak_bytes(lambda: export_safetensors(ckpt, out)))
print(peak_bytes(lambda: convert_hf_to_bcp(out, back)))
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc peak-RSS reset")
def test_export_memory_is_bounded_by_the_largest_tensor(tmp_path):
    largest = 8 << 20
    g = torch.Generator().manual_seed(0)
    # 12 tensors of 8 MiB, each saved as 2 shards: the checkpoint is 12 times its largest tensor.
    state = {f"layer{i}.weight": [bcp.TensorShard(torch.randn(256, 4096, generator=g), (512, 4096), (256 * k, 0))
                                  for k in range(2)] for i in range(12)}
    bcp.save(str(tmp_path / "ckpt"), {"model": state})
    bcp.save(str(tmp_path / "tiny"), {"model": {"w": torch.ones(4)}})
    total = sum(t.tensor.numel() * 4 for pieces in state.values() for t in pieces)
    assert total == 12 * largest
    del state

    # glibc keeps freed blocks below its dynamic mmap threshold (up to 32 MiB) in the heap for reuse, so
    # the resident size would show that cache rather than live memory; a fixed threshold returns them.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    run = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                          str(tmp_path / "tiny"), str(tmp_path / "back")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    export_peak, convert_peak = (int(line) for line in run.stdout.split())
    assert export_peak < 3 * largest, export_peak  # about one tensor and its shard buffers, not the model
    assert convert_peak < 3 * largest, convert_peak
    print(f"peak RSS growth: export {export_peak >> 20} MiB, convert {convert_peak >> 20} MiB, model {total >> 20} MiB")
