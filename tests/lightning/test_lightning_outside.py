"""bcp_lightning checkpoints without a Trainer: docs/lightning.md's "Outside Lightning" block runs
on a checkpoint of every kind (the plugin under Lightning's own DDP on two processes, where the
optimizer state is kept by index among Lightning's entries; BCPDDPStrategy on two processes, by
parameter name; the plugin on one device) and gives back the saved model and optimizer state.
Before, the documented ``bcp.load`` with ``optimizer`` failed on the plugin's checkpoints
(``missing from the checkpoint: optimizer/param_groups``), and ``load_from_checkpoint`` failed on
every bcp checkpoint with ``IsADirectoryError``, which Lightning still raises for its own method."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import bcp_lightning
from bcp_lightning import BCPCheckpointIO
from doc_blocks import block_covered_by
from lightning_launch import run
from lightning_worker import Data, LitMLP

THIS = "tests/lightning/test_lightning_outside.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Folders holding ``checkpoints/last.ckpt`` by kind, with the whole state when it was saved."""
    root = tmp_path_factory.mktemp("outside")
    kinds = {"ddp_plugin": {"strategy": "ddp", "plugin": True}, "bcp_ddp": {"strategy": "bcp_ddp"}}
    cases = [{"case": "fit", "args": {"dirpath": str(root / kind / "checkpoints"), "epochs": 1, **args}}
             for kind, args in kinds.items()]
    results = run(2, cases, str(root / "launch"))
    out = {kind: (root / kind, results[0][i]["final"]["state"]) for i, kind in enumerate(kinds)}
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[BCPCheckpointIO()], max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=root / "single_plugin" / "checkpoints", save_last=True)])
    model = LitMLP()
    trainer.fit(model, datamodule=Data())
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, per_param in trainer.optimizers[0].state.items():
        state.update({f"optimizer0/{names[id(p)]}/{k}": torch.as_tensor(v).clone() for k, v in per_param.items()})
    out["single_plugin"] = (root / "single_plugin", state)
    return out


@pytest.mark.parametrize("kind", ["ddp_plugin", "bcp_ddp", "single_plugin"])
def test_the_docs_outside_lightning_block_on_every_kind_of_checkpoint(saved, kind, monkeypatch):
    folder, expected = saved[kind]
    block = block_covered_by(THIS, "test_the_docs_outside_lightning_block_on_every_kind_of_checkpoint")
    monkeypatch.chdir(folder)
    scope = {"MyLightningModule": LitMLP}
    exec(compile(block.code, block.id, "exec"), scope)
    model, optimizer, checkpoint = scope["model"], scope["optimizer"], scope["checkpoint"]
    for fqn, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[f"model/{fqn}"]), fqn
    names = {id(p): n for n, p in model.named_parameters()}
    loaded = {f"optimizer0/{names[id(p)]}/{k}": torch.as_tensor(v)
              for p, per_param in optimizer.state.items() for k, v in per_param.items()}
    assert loaded.keys() == {k for k in expected if k.startswith("optimizer0/")}
    for name, value in loaded.items():
        assert torch.equal(value, expected[name]), name
    assert checkpoint["epoch"] == 0 and checkpoint["hyper_parameters"]["layout"] == "replicated"
    assert "optimizer_states" not in checkpoint and "state_dict" not in checkpoint


def test_load_from_checkpoint_builds_the_module_as_lightning_does(saved, tmp_path):
    folder, expected = saved["bcp_ddp"]
    path = folder / "checkpoints" / "last.ckpt"
    model = bcp_lightning.load_from_checkpoint(LitMLP, path, lr=0.5)  # an override, as Lightning takes them
    assert type(model) is LitMLP and model.hparams.lr == 0.5 and model.hparams.layout == "replicated"
    for fqn, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[f"model/{fqn}"]), fqn
    with pytest.raises(IsADirectoryError):  # Lightning's own method reads torch files only
        LitMLP.load_from_checkpoint(path)
    # a torch file goes to Lightning's own method
    torch_file = tmp_path / "model.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                "pytorch-lightning_version": L.__version__}, torch_file)
    again = bcp_lightning.load_from_checkpoint(LitMLP, torch_file)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
