"""One rank of a Lightning job: ``main()`` reads the SPEC.json that ``sys.argv[1]`` names. Started
once per rank by ``lightning_launch.run`` with the environment Lightning reads for externally
launched processes.

A job runs several cases in order, each a real Trainer run (each builds its own Trainer, model and
data), so one launch serves many checks. Each case returns plain data and CPU tensors: losses per
step, and whole-state snapshots (every model and optimizer tensor, gathered with torch's own
``get_*_state_dict(full_state_dict=True)``, independent of bcp) taken when a checkpoint is saved,
right after one is restored and at the end. Results go to ``result-<rank>.pt``; the tests assert.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import bcp  # noqa: E402
import loader_workers  # noqa: E402
from bcp_lightning import (  # noqa: E402
    BCPCheckpointIO,
    BCPDDPStrategy,
    BCPFSDPStrategy,
    BCPModelParallelStrategy,
    MEMORY_TIER,
    MemoryTierCheckpoint,
)
from models import MLP  # noqa: E402
import lightning_optimizer_cases  # noqa: E402

SAMPLES = 48
BATCH = 4
# Read once: Lightning's environment deletes WORLD_SIZE from os.environ when a run tears down.
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


class LitMLP(L.LightningModule):
    """tests/models.MLP; ``layout`` says how ``configure_model`` parallelises it."""

    def __init__(self, layout: str = "replicated", lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng():  # the same weights every time, the caller's RNG untouched
            torch.manual_seed(0)
            self.net = MLP()

    def configure_model(self) -> None:
        if self.hparams.layout == "fsdp2":
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if not isinstance(self.net, FSDPModule):
                mesh = self.device_mesh["data_parallel"]
                fully_shard(self.net.fc1, mesh=mesh)
                fully_shard(self.net.fc2, mesh=mesh)
                fully_shard(self.net, mesh=mesh)
        elif self.hparams.layout == "tp":
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            if not hasattr(self.net.fc1.weight, "placements"):
                parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                                   {"fc1": ColwiseParallel(output_layouts=Replicate()),
                                    "fc2": RowwiseParallel(input_layouts=Replicate())})
        elif self.hparams.layout == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            # The test's CPU workaround: Lightning wraps with device_id=None, which FSDP1 refuses
            # without an accelerator; wrapped here, Lightning leaves the module as it is.
            if not isinstance(self.net, FSDP):
                self.net = FSDP(self.net, device_id=torch.device("cpu"), use_orig_params=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}


class Data(L.LightningDataModule):
    """Fixed random data; ``loaders_made`` is the datamodule's checkpointed state. With ``stateful``
    the train loader is a torchdata ``StatefulDataLoader``, so a resume mid-epoch continues its epoch."""

    def __init__(self, shuffle: bool = True, stateful: bool = False) -> None:
        super().__init__()
        self.shuffle, self.stateful = shuffle, stateful
        self.loaders_made = 0

    def train_dataloader(self) -> Any:
        self.loaders_made += 1
        if self.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(_dataset(0), batch_size=BATCH, shuffle=self.shuffle)
        return torch.utils.data.DataLoader(_dataset(0), batch_size=BATCH, shuffle=self.shuffle)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(_dataset(1), batch_size=BATCH)

    def state_dict(self) -> dict[str, Any]:
        return {"loaders_made": self.loaders_made}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaders_made = state_dict["loaders_made"]


def _dataset(seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 12, generator=g), torch.randn(SAMPLES, 7, generator=g))


def full_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, whole, by FQN (a collective: all ranks call it). An
    optimizer without state is left out: torch's get_optimizer_state_dict would create its state
    with a step."""
    options = StateDictOptions(full_state_dict=True)
    model = trainer.strategy.model
    out = {f"model/{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
    for i, optimizer in enumerate(o for o in trainer.optimizers if any(o.state.values())):
        state = get_optimizer_state_dict(model, optimizer, options=options)["state"]
        for fqn, per_param in state.items():
            out.update({f"optimizer{i}/{fqn}/{k}": torch.as_tensor(v).detach().clone() for k, v in per_param.items()})
    return out


class Recorder(Callback):
    """Losses per global step, learning rates per epoch and whole-state snapshots at saves and
    right after a restore."""

    def __init__(self, resumed: bool) -> None:
        self.resumed = resumed
        self.losses: dict[int, float] = {}
        self.lrs: dict[int, float] = {}
        self.saved: dict[int, dict[str, torch.Tensor]] = {}
        self.saved_lrs: dict[int, float] = {}
        self.restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.resumed:
            self.restored = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                             "state": full_state(trainer)}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.lrs[trainer.current_epoch] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses[trainer.global_step] = outputs["loss"].item()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.saved[trainer.global_step] = full_state(trainer)
        self.saved_lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


class SaveAtStart(Callback):
    """``Trainer.save_checkpoint(path)`` when training starts, before any optimizer step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


STRATEGIES = {
    "ddp": lambda: DDPStrategy(),
    "bcp_ddp": lambda: BCPDDPStrategy(),
    "bcp_fsdp": lambda: BCPFSDPStrategy(),
    "bcp_fsdp2": lambda: BCPModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1),
    "bcp_tp": lambda: BCPModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=WORLD_SIZE),
    "single": lambda: "auto",
}
LAYOUTS = {"ddp": "replicated", "bcp_ddp": "replicated", "bcp_fsdp": "fsdp1", "bcp_fsdp2": "fsdp2", "bcp_tp": "tp",
           "single": "replicated"}


def fit(strategy: str, dirpath: str, epochs: int, resume_from: str | None = None, plugin: bool = False,
        async_save: bool = False, keep_generations: int = 1, load_generation: int | None = None,
        save_last: Any = True, top_k: int = -1, monitor: str = "val_loss",
        extra_saves: tuple[tuple[Any, ...], ...] = (), save_at_start: str | None = None) -> dict[str, Any]:
    """One ``Trainer.fit``; ``plugin`` adds BCPCheckpointIO (for Lightning's own strategies, or an
    asynchronous one with ``async_save``); after
    it, ``Trainer.save_checkpoint(path, weights_only[, storage_options])`` for each of ``extra_saves``.
    ``keep_generations``/``load_generation`` are the plugin's (and add it). Monitoring
    ``"step"`` (always improving) makes every epoch replace the worst of the top k. ``save_at_start``
    saves a checkpoint there before the first optimizer step."""
    recorder = Recorder(resumed=resume_from is not None)
    checkpointing = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", monitor=monitor, save_top_k=top_k,
                                    mode="max" if monitor == "step" else "min", save_last=save_last)
    generations = {"keep_generations": keep_generations, "load_generation": load_generation}
    with_plugin = plugin or async_save or generations != {"keep_generations": 1, "load_generation": None}
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=STRATEGIES[strategy](),
        plugins=[BCPCheckpointIO(async_save=async_save, **generations)] if with_plugin else None, max_epochs=epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[recorder, checkpointing, EarlyStopping("val_loss", patience=100),
                   *([SaveAtStart(save_at_start)] if save_at_start else [])])
    data = Data()
    trainer.fit(LitMLP(LAYOUTS[strategy]), datamodule=data, ckpt_path=resume_from)
    for path, weights_only, *storage_options in extra_saves:
        trainer.save_checkpoint(path, weights_only=weights_only, storage_options=next(iter(storage_options), None))
    return {"losses": recorder.losses, "lrs": recorder.lrs, "saved": recorder.saved, "saved_lrs": recorder.saved_lrs,
            "restored": recorder.restored, "final": {"global_step": trainer.global_step, "state": full_state(trainer)},
            "loaders_made": data.loaders_made,
            "files": sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else [],
            "best_k": sorted(os.path.basename(p) for p in checkpointing.best_k_models)}


def expect_error(strategy: str, dirpath: str, resume_from: str) -> str:
    """The message of the error a resume raises (the same on every rank)."""
    try:
        fit(strategy, dirpath, epochs=1, resume_from=resume_from)
    except Exception as exc:  # the test asserts on the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def count_collectives(strategy: str, path: str) -> dict[str, Any]:
    """After one epoch, the collectives on the training process group (the world; bcp plans over
    its own group) while ``Trainer.save_checkpoint(path)`` runs and while the strategy loads that
    checkpoint back; the whole state when saved."""
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=STRATEGIES[strategy](), max_epochs=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        enable_checkpointing=False)
    trainer.fit(LitMLP(LAYOUTS[strategy]), datamodule=Data())
    world = torch.distributed.group.WORLD
    before = world._get_sequence_number_for_group()
    trainer.save_checkpoint(path)
    after_save = world._get_sequence_number_for_group()
    saved = full_state(trainer)
    after_snapshot = world._get_sequence_number_for_group()
    trainer.strategy.load_checkpoint(path)
    after_load = world._get_sequence_number_for_group()
    return {"save": after_save - before, "load": after_load - after_snapshot, "saved": saved,
            "global_step": trainer.global_step}


def pickle_model(strategy: str, dirpath: str, plugin: bool = False, async_save: bool = False) -> dict[str, Any]:
    """After ``fit`` with bcp checkpointing, ``torch.save`` the LightningModule with the trainer's
    checkpoint plugin and ``torch.load`` them back; returns the live and the reloaded weights, the
    reloaded objects' classes and whether the plugin kept its options."""
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=STRATEGIES[strategy](),
        plugins=[BCPCheckpointIO(async_save=async_save)] if plugin or async_save else None, max_epochs=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)])
    model = LitMLP(LAYOUTS[strategy])
    trainer.fit(model, datamodule=Data())
    assert trainer.strategy.checkpoint_io is not None
    path = os.path.join(dirpath, f"model-rank{trainer.global_rank}.pt")
    plugin = trainer.strategy.checkpoint_io
    torch.save({"model": model, "plugin": plugin}, path)
    reloaded = torch.load(path, weights_only=False)
    return {"live": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "reloaded": {k: v.detach().clone() for k, v in reloaded["model"].state_dict().items()},
            "classes": [type(reloaded["model"]).__name__, type(reloaded["plugin"]).__name__],
            "same_options": reloaded["plugin"].options == plugin.options}


def fit_tier(strategy: str, tier: dict[str, Any] | None, max_steps: int, every: int, resume: str | bool = False,
             dirpath: str | None = None) -> dict[str, Any]:
    """``Trainer.fit`` up to ``max_steps`` with ``BCPCheckpointIO(memory_tier=bcp.MemoryTier(**tier))``
    (its ``nodes`` list as long as the job) and a ``MemoryTierCheckpoint`` saving every ``every``
    steps; with ``resume``, from ``ckpt_path=MEMORY_TIER``. Without ``tier`` a ``ModelCheckpoint``
    saves to ``dirpath`` at the same steps instead, and ``resume`` is a checkpoint path. The train
    loader is stateful, so a resume mid-epoch continues its epoch."""
    torch.manual_seed(0)  # the sampler's shuffling draws from it (a resume restores the loader's own state)
    recorder = Recorder(resumed=bool(resume))
    if tier is not None:
        plugins = [BCPCheckpointIO(memory_tier=bcp.MemoryTier(**tier))]
        saving = MemoryTierCheckpoint(every_n_train_steps=every)
        ckpt_path = MEMORY_TIER if resume else None
    else:
        plugins = [BCPCheckpointIO()] if strategy == "single" else None
        saving = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=-1, filename="{step}")
        ckpt_path = resume or None
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=STRATEGIES[strategy](), max_steps=max_steps, plugins=plugins,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[recorder, saving])
    trainer.fit(LitMLP(LAYOUTS[strategy]), datamodule=Data(stateful=True), ckpt_path=ckpt_path)
    loaded = getattr(trainer.strategy.checkpoint_io, "last_load", None)
    return {"losses": recorder.losses, "saved": recorder.saved, "restored": recorder.restored,
            "source": loaded.source if loaded else None, "reason": loaded.source_reason if loaded else None}


def tier_error(strategy: str, tier: dict[str, Any]) -> str:
    """The message of the error a ``fit_tier`` run raises (the same on every rank)."""
    try:
        fit_tier(strategy, tier, max_steps=2, every=1)
    except Exception as exc:  # the test asserts on the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def optimizer_semantics(strategy: str, dirpath: str, case_ids: list[str], steps: int) -> dict[str, list[str]]:
    """``lightning_optimizer_cases.compare_cases`` under ``strategy`` (``single``: Lightning's own
    single-device strategy with BCPCheckpointIO)."""
    plugins = (lambda: [BCPCheckpointIO()]) if strategy == "single" else (lambda: None)
    return lightning_optimizer_cases.compare_cases(STRATEGIES[strategy], plugins, LAYOUTS[strategy] == "fsdp2",
                                                   dirpath, case_ids, steps)


class EpochIds(L.LightningModule):
    """Records, per epoch, the sample ids of every batch it trains on; its train loader is a
    StatefulDataLoader with 2 read workers over ids 0..95 (``shuffle``: the loader's own), with the
    DistributedSampler Lightning puts in (``sampler="lightning"``) or bcp's (``"bcp"``)."""

    def __init__(self, shuffle: bool, sampler: str) -> None:
        super().__init__()
        self.shuffle, self.sampler = shuffle, sampler
        self.layer = nn.Linear(1, 1)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).extend(batch[0].tolist())
        return self.layer(batch[0].float().unsqueeze(1)).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader_workers.start_from_fork_server()  # the workers need torch's dataset alone
        ids = torch.utils.data.TensorDataset(torch.arange(96))
        if self.sampler == "lightning":
            return StatefulDataLoader(ids, batch_size=4, shuffle=self.shuffle, num_workers=2)
        sampler = bcp.ResumableDistributedSampler(96, dp_rank=self.trainer.global_rank,
                                                  dp_size=self.trainer.world_size, shuffle=self.shuffle, seed=5)
        return StatefulDataLoader(ids, batch_size=4, sampler=sampler, num_workers=2)


class SaveAtSteps(Callback):
    """``Trainer.save_checkpoint(<dirpath>/step=<n>.ckpt)`` after the optimizer steps in ``steps``."""

    def __init__(self, dirpath: str, steps: list[int]) -> None:
        self.dirpath, self.steps = dirpath, set(steps)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(os.path.join(self.dirpath, f"step={trainer.global_step}.ckpt"))


LOADER_TRAINERS = {
    "ddp": lambda: {"strategy": DDPStrategy(), "plugins": [BCPCheckpointIO()]},
    "bcp_ddp": lambda: {"strategy": BCPDDPStrategy()},
    "single": lambda: {"strategy": "auto", "plugins": [BCPCheckpointIO()]},
}


def fit_epochs(dirpath: str, trainer: str, shuffle: bool, sampler: str = "lightning", epochs: int = 1,
               save_at: tuple[int, ...] = (), resume_from: str | None = None, max_steps: int = -1,
               seed: str = "alike", gather: bool = True) -> dict[int, list[int]]:
    """A fit of :class:`EpochIds` (``trainer``: Lightning's DDPStrategy with BCPCheckpointIO, BCPDDPStrategy,
    or a single-device Trainer with BCPCheckpointIO), saving after the steps ``save_at``; per epoch,
    the ids this rank trained on. ``seed``: every rank's global RNG seeded alike (a shuffled loader's
    sampler seeds its generator from it), or ``"per_rank"``. ``gather=False`` saves through the plugin
    under Lightning's DDP as a bcp_lightning that did not gather the ranks' loader positions did (for
    the rest of the process)."""
    if not gather:
        from bcp_lightning import loader_states

        loader_states._gather_at_saves = lambda trainer: None
    L.seed_everything(int(os.environ["LOCAL_RANK"]) if seed == "per_rank" else 0, verbose=False)
    run = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, max_epochs=epochs, max_steps=max_steps, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    use_distributed_sampler=sampler == "lightning", callbacks=[SaveAtSteps(dirpath, list(save_at))],
                    **LOADER_TRAINERS[trainer]())
    module = EpochIds(shuffle, sampler)
    run.fit(module, ckpt_path=resume_from)
    return module.seen


def fit_epochs_error(**args: Any) -> str:
    """The message of the error :func:`fit_epochs` raises."""
    try:
        fit_epochs(**args)
    except Exception as exc:  # the test asserts on the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


CASES = {"fit": fit, "expect_error": expect_error, "count_collectives": count_collectives,
         "pickle_model": pickle_model, "fit_epochs": fit_epochs, "fit_epochs_error": fit_epochs_error,
         "fit_tier": fit_tier, "tier_error": tier_error, "optimizer_semantics": optimizer_semantics}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(os.environ["LOCAL_RANK"])
    results = []
    for case in spec["cases"]:
        # The launcher's request for stacks on a hang, installed again before each case: a Trainer's
        # teardown resets every signal to Python's view of it, and faulthandler reinstalls a handler
        # it still counts as registered only after unregistering it.
        faulthandler.unregister(signal.SIGUSR2)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        results.append(CASES[case["case"]](**case["args"]))
    torch.save(results, os.path.join(spec["out"], f"result-{rank}.pt"))
