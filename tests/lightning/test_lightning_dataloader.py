"""The fit loop's dataloader state through bcp_lightning: a real Trainer whose train dataloader is a
torchdata ``StatefulDataLoader`` checkpoints mid-epoch, and a run resumed from that checkpoint trains
on exactly the batches the uninterrupted run trained on; the loader's state lies in the checkpoint's
``dataloader`` component, not among Lightning's other entries."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from bcp.api.checkpoint import open_checkpoint
from bcp_lightning import BCPCheckpointIO
from lightning.pytorch.plugins import TorchCheckpointIO

SAVED_AT, TOTAL = 4, 9  # steps; an epoch has 10 batches, so the checkpoint is mid-epoch


class Recorder(L.LightningModule):
    """Trains a linear layer and records the sample ids of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        self.seen.append(batch[0].tolist())
        return self.layer(batch[0].float().unsqueeze(1)).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> StatefulDataLoader:
        generator = torch.Generator().manual_seed(3)
        return StatefulDataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True, generator=generator)


def _fit(tmp_path, name: str, resume_from: str | None = None) -> list[list[int]]:
    torch.manual_seed(0)
    module = Recorder()
    every = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=SAVED_AT, save_top_k=-1,
                            filename="{step}")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=TOTAL, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[every], plugins=[BCPCheckpointIO()])
    trainer.fit(module, ckpt_path=resume_from)
    return module.seen


def test_a_resumed_fit_trains_on_the_batches_of_the_uninterrupted_one(tmp_path):
    uninterrupted = _fit(tmp_path, "first")
    checkpoint = str(tmp_path / "first" / f"step={SAVED_AT}.ckpt")
    resumed = _fit(tmp_path, "second", resume_from=checkpoint)
    assert len(uninterrupted) == TOTAL
    assert resumed == uninterrupted[SAVED_AT:]
    saved = open_checkpoint(checkpoint)
    assert {"dataloader/replicated", "dataloader/shard/dp0-of-1/worker0-of-1"} <= set(saved.objects)
    rest = saved.read_object("lightning")
    assert "combined_loader" not in rest["loops"]["fit_loop"]["state_dict"]


class Stream(torch.utils.data.IterableDataset):
    """Ids 0..39 as a stream whose position is its state (torchdata restores it in the loader)."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        while self.position < 40:
            self.position += 1
            yield (self.position - 1,)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class StreamRecorder(Recorder):
    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(Stream(), batch_size=4)


def _fit_stream(folder, checkpoint_io, resume_from=None) -> list[list[int]]:
    module = StreamRecorder()
    every = ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVED_AT, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[every], plugins=[checkpoint_io])
    trainer.fit(module, ckpt_path=resume_from)
    return module.seen


def test_an_iterable_loader_resumes_as_lightnings_own_engine_resumes_it(tmp_path):
    """bcp follows no order in an iterable dataset: the loader's own state is saved and restored, and
    the resumed fit trains on the batches a resume through Lightning's TorchCheckpointIO gives (Lightning
    fetches one batch ahead from a loader without a length, so both skip the batch fetched ahead)."""
    resumed = {}
    for name, checkpoint_io in (("torch", TorchCheckpointIO()), ("bcp", BCPCheckpointIO())):
        _fit_stream(tmp_path / name, checkpoint_io)
        resumed[name] = _fit_stream(tmp_path / f"{name}-again", checkpoint_io,
                                    resume_from=str(tmp_path / name / f"step={SAVED_AT}.ckpt"))
    assert resumed["bcp"] == resumed["torch"] and resumed["bcp"][0] == [20, 21, 22, 23]
