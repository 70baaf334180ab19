"""Hugging Face round trips: 2-rank FSDP2 -> bcp -> safetensors -> ``from_pretrained``, and a
``save_pretrained`` folder -> ``bcp convert`` -> ``bcp.load`` into 2-rank FSDP2; same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

import bcp
from bcp.cli import main
from tools_hf_models import fully_shard_llama, llama, llama_config, logits, train_step

transformers = pytest.importorskip("transformers")


def train_shard_save(path: str) -> torch.Tensor:
    model = llama(seed=0)
    fully_shard_llama(model)
    train_step(model)
    bcp.save(path, {"model": model})
    return logits(model)


def load_sharded(path: str) -> tuple[torch.Tensor, list[str]]:
    model = llama(seed=5)
    fully_shard_llama(model)
    result = bcp.load(path, {"model": model})
    return logits(model), result.loaded


def test_fsdp2_checkpoint_exports_to_from_pretrained(ranks, tmp_path):
    ckpt, config_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "config"), str(tmp_path / "hf")
    live = ranks(2).run(train_shard_save, ckpt)
    assert torch.equal(live[0], live[1])
    llama_config().save_pretrained(config_dir)

    assert main(["export", ckpt, "--to", "safetensors", out, "--config", config_dir]) == 0

    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied: written once
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), live[0])


def test_sharded_export_with_index_loads_with_from_pretrained(ranks, tmp_path):
    ckpt, config, out = str(tmp_path / "ckpt"), str(tmp_path / "config.json"), str(tmp_path / "hf")
    live = ranks(2).run(train_shard_save, ckpt)
    llama_config().to_json_file(config)

    assert main(["export", ckpt, "--to", "safetensors", out, "--max-shard-size", "20KB", "--keep-tied",
                 "--config", config]) == 0

    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == files
    assert "lm_head.weight" in index["weight_map"]  # --keep-tied writes every name
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), live[0])


def test_hf_folder_converts_and_loads_into_fsdp2(ranks, tmp_path):
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    reference = llama(seed=3)
    reference.save_pretrained(hf_dir)
    assert main(["convert", "--from", "hf", hf_dir, ckpt]) == 0

    results = ranks(2).run(load_sharded, ckpt)

    expected = logits(reference)
    for rank_logits, loaded in results:
        assert torch.equal(rank_logits, expected)
        assert "model/lm_head.weight" in loaded  # the tie comes from config.json: a strict load finds it
