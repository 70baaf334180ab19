"""Real Trainer runs on several CPU processes: checkpoints saved by bcp_lightning resume on another
world size and with another strategy, bitwise; in the same layout the loss curve continues as if
training had never stopped.

Three launches serve every case (a launch costs seconds): one process, then two, then one again,
each later launch resuming the checkpoints of the earlier ones. Whole-state snapshots (every model
and optimizer tensor, gathered by torch, independent of bcp) are taken at each save and right after
each restore; see ``lightning_worker.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

import bcp
from bcp.api.metrics import OpRecord
from bcp.api.metrics_log import read_records
from lightning_launch import run
from models import MLP, assert_bitwise

pytestmark = pytest.mark.distributed

STEPS_PER_EPOCH = {1: 12, 2: 6}  # 48 samples, batches of 4 per rank


def fit(strategy: str, dirpath: str, epochs: int, **args) -> dict:
    return {"case": "fit", "args": {"strategy": strategy, "dirpath": dirpath, "epochs": epochs, **args}}


def count(strategy: str, path: str) -> dict:
    return {"case": "count_collectives", "args": {"strategy": strategy, "path": path}}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lightning"))


@pytest.fixture(scope="module")
def one_process(root) -> dict:
    """FSDP2 (ModelParallelStrategy) on one process, saving for the two-process launch."""
    (mp1,) = run(1, [fit("bcp_fsdp2", f"{root}/mp1", 2)], f"{root}/launch-1")[0]
    return {"mp1": mp1}


@pytest.fixture(scope="module")
def two_processes(root, one_process) -> dict:
    r = root
    cases = {
        # Lightning's DDPStrategy with the plugin alone: an uninterrupted run, then a resume of it.
        "ddp_plugin": fit("ddp", f"{r}/ddp_plugin", 4, plugin=True, save_last="link"),
        "ddp_plugin_resumed": fit("ddp", f"{r}/ddp_plugin_resumed", 4, plugin=True,
                                  resume_from=f"{r}/ddp_plugin/epoch=1.ckpt"),
        # BCPDDPStrategy: the same, plus Trainer.save_checkpoint (with storage_options) and top-k removal.
        "bcp_ddp": fit("bcp_ddp", f"{r}/bcp_ddp", 3, top_k=2, monitor="step",
                       extra_saves=[[f"{r}/bcp_ddp/explicit.ckpt", False, {"verify_replicas": True, "io_threads": 1}],
                                    [f"{r}/weights_only.ckpt", True]]),
        # Lightning's DDPStrategy and its default TorchCheckpointIO: single-file checkpoints.
        "ddp_torch": fit("ddp", f"{r}/ddp_torch", 2),
        "bcp_ddp_resumed": fit("bcp_ddp", f"{r}/bcp_ddp_resumed", 3, resume_from=f"{r}/bcp_ddp/epoch=1.ckpt"),
        # DDP -> ModelParallel (FSDP2) on two processes; this run's last checkpoint goes to one process.
        "ddp_to_fsdp2": fit("bcp_fsdp2", f"{r}/mp2", 4, resume_from=f"{r}/bcp_ddp/explicit.ckpt"),
        "ddp_to_tp": fit("bcp_tp", f"{r}/tp", 4, resume_from=f"{r}/bcp_ddp/explicit.ckpt"),
        "fsdp2_1_to_2": fit("bcp_fsdp2", f"{r}/mp1to2", 3, resume_from=f"{r}/mp1/last.ckpt"),
        "fsdp1": fit("bcp_fsdp", f"{r}/fsdp1", 2, top_k=1, monitor="step", async_save=True),
        # Collectives of a save and a load: FSDP1's against DDP's (which has nothing to gather).
        "fsdp1_collectives": count("bcp_fsdp", f"{r}/fsdp1_counted.ckpt"),
        "ddp_collectives": count("bcp_ddp", f"{r}/ddp_counted.ckpt"),
        "fsdp1_counted_resumed": fit("bcp_fsdp", f"{r}/fsdp1_resumed", 2, resume_from=f"{r}/fsdp1_counted.ckpt"),
    }
    results = run(2, list(cases.values()), f"{r}/launch-2")
    return {name: [rank[i] for rank in results] for i, name in enumerate(cases)}


@pytest.fixture(scope="module")
def back_to_one(root, two_processes) -> dict:
    r = root
    cases = {
        "ddp_plugin_2_to_1": fit("single", f"{r}/p3-a", 3, plugin=True, resume_from=f"{r}/ddp_plugin/epoch=1.ckpt"),
        "bcp_ddp_2_to_1": fit("bcp_ddp", f"{r}/p3-b", 3, resume_from=f"{r}/bcp_ddp/epoch=1.ckpt"),
        "fsdp2_2_to_1": fit("bcp_fsdp2", f"{r}/p3-c", 5, resume_from=f"{r}/mp2/last.ckpt"),
        "tp_2_to_fsdp2_1": fit("bcp_fsdp2", f"{r}/p3-h", 5, resume_from=f"{r}/tp/last.ckpt"),
        "fsdp1_2_to_1": fit("bcp_fsdp", f"{r}/p3-d", 3, resume_from=f"{r}/fsdp1/last.ckpt"),
        # A strategy's checkpoint (FQN-keyed optimizer) resumed by the plugin alone, single device.
        "bcp_ddp_to_plugin": fit("single", f"{r}/p3-e", 3, plugin=True, resume_from=f"{r}/bcp_ddp/epoch=1.ckpt"),
        "index_keyed_into_fsdp2": {"case": "expect_error", "args": {
            "strategy": "bcp_fsdp2", "dirpath": f"{r}/p3-f", "resume_from": f"{r}/ddp_plugin/epoch=1.ckpt"}},
        "weights_only_resume": {"case": "expect_error", "args": {
            "strategy": "bcp_ddp", "dirpath": f"{r}/p3-g", "resume_from": f"{r}/weights_only.ckpt"}},
        # A run switches to bcp: the plugin resumes its TorchCheckpointIO file (2 -> 1); a strategy says how.
        "torch_file_to_plugin": fit("single", f"{r}/p3-i", 3, plugin=True, resume_from=f"{r}/ddp_torch/epoch=1.ckpt"),
        "torch_file_into_strategy": {"case": "expect_error", "args": {
            "strategy": "bcp_ddp", "dirpath": f"{r}/p3-j", "resume_from": f"{r}/ddp_torch/epoch=1.ckpt"}},
    }
    (results,) = run(1, list(cases.values()), f"{r}/launch-3")
    return dict(zip(cases, results))


def saved_at_epoch_end(run_result: dict, epoch: int, world_size: int) -> dict:
    return run_result["saved"][(epoch + 1) * STEPS_PER_EPOCH[world_size]]


def assert_resumed_from(resumed: dict, saved: dict, step: int) -> None:
    assert resumed["restored"]["global_step"] == step
    assert_bitwise(saved, resumed["restored"]["state"])


@pytest.mark.parametrize("name", ["ddp_plugin", "bcp_ddp"])
def test_ddp_resume_on_two_continues_the_loss_curve(two_processes, name):
    reference, resumed = two_processes[name], two_processes[f"{name}_resumed"]
    step = 2 * STEPS_PER_EPOCH[2]
    for ref, res in zip(reference, resumed):  # per rank: each rank's losses on its own data
        assert_resumed_from(res, ref["saved"][step], step)
        assert res["restored"]["epoch"] == 2
        assert min(res["losses"]) == step + 1
        assert res["losses"] == {s: ref["losses"][s] for s in res["losses"]}
        assert res["final"]["global_step"] == ref["final"]["global_step"]
        assert_bitwise(ref["final"]["state"], res["final"]["state"])
        assert res["lrs"] == {e: ref["lrs"][e] for e in res["lrs"]}  # the lr scheduler resumed
        assert res["loaders_made"] == 2  # the datamodule's state came back, then made a loader


@pytest.mark.parametrize("saved_by,resumed_by", [("ddp_plugin", "ddp_plugin_2_to_1"), ("bcp_ddp", "bcp_ddp_2_to_1"),
                                                 ("bcp_ddp", "bcp_ddp_to_plugin")])
def test_ddp_resume_on_one_process(two_processes, back_to_one, saved_by, resumed_by):
    step = 2 * STEPS_PER_EPOCH[2]
    resumed = back_to_one[resumed_by]
    assert_resumed_from(resumed, two_processes[saved_by][0]["saved"][step], step)
    assert resumed["final"]["global_step"] == step + STEPS_PER_EPOCH[1]


def test_fsdp2_one_to_two_and_two_to_one(one_process, two_processes, back_to_one):
    one_to_two = two_processes["fsdp2_1_to_2"]
    for rank in one_to_two:
        assert_resumed_from(rank, saved_at_epoch_end(one_process["mp1"], 1, 1), 2 * STEPS_PER_EPOCH[1])
    two_to_one = back_to_one["fsdp2_2_to_1"]
    saved = two_processes["ddp_to_fsdp2"][0]
    assert_resumed_from(two_to_one, saved["saved"][saved["final"]["global_step"]], saved["final"]["global_step"])


@pytest.mark.parametrize("into", ["ddp_to_fsdp2", "ddp_to_tp"])
def test_ddp_to_model_parallel(two_processes, into):
    step = 3 * STEPS_PER_EPOCH[2]  # Trainer.save_checkpoint after three epochs
    for saved, resumed in zip(two_processes["bcp_ddp"], two_processes[into]):
        assert_resumed_from(resumed, saved["saved"][step], step)


def test_tensor_parallel_two_to_fsdp2_one(two_processes, back_to_one):
    saved = two_processes["ddp_to_tp"][0]
    step = saved["final"]["global_step"]
    assert_resumed_from(back_to_one["tp_2_to_fsdp2_1"], saved["saved"][step], step)


def test_fsdp1_two_to_one(two_processes, back_to_one):
    saved = two_processes["fsdp1"][0]
    step = 2 * STEPS_PER_EPOCH[2]
    assert_resumed_from(back_to_one["fsdp1_2_to_1"], saved["saved"][step], step)


def test_fsdp1_saves_and_loads_with_no_collective_but_bcps_planning(two_processes):
    # On the training group, FSDP1's save and load take only what DDP's do: Lightning's broadcast
    # of the path from rank 0 (two broadcasts) and, for the save, Trainer.save_checkpoint's barrier.
    # torch's sharded state dict all-gathers parameters and exchanges optimizer state there.
    for fsdp1, ddp in zip(two_processes["fsdp1_collectives"], two_processes["ddp_collectives"]):
        assert (fsdp1["save"], fsdp1["load"]) == (ddp["save"], ddp["load"]) == (3, 2)
    for saved, resumed in zip(two_processes["fsdp1_collectives"], two_processes["fsdp1_counted_resumed"]):
        assert_resumed_from(resumed, saved["saved"], saved["global_step"])
        assert resumed["final"]["global_step"] == 2 * STEPS_PER_EPOCH[2]


def test_model_checkpoint_top_k_and_last(root, two_processes):
    for name, kept in [("bcp_ddp", ["epoch=1.ckpt", "epoch=2.ckpt", "explicit.ckpt"]), ("fsdp1", ["epoch=1.ckpt"])]:
        for rank in two_processes[name]:
            assert rank["files"] == sorted(kept + ["last.ckpt"])
    assert os.readlink(f"{root}/ddp_plugin/last.ckpt") == "epoch=3.ckpt"  # save_last="link"


def test_plain_bcp_load_of_lightning_checkpoints(root, two_processes):
    step = 2 * STEPS_PER_EPOCH[2]
    for saved_by, with_optimizer in [("ddp_plugin", False), ("bcp_ddp", True)]:
        model = MLP()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        net = torch.nn.Module()
        net.net = model  # the LightningModule's attribute name, so the FQNs match
        state = {"model": net, "lightning": None}
        if with_optimizer:
            state["optimizer"] = optimizer
        bcp.load(f"{root}/{saved_by}/epoch=1.ckpt", state)
        expected = two_processes[saved_by][0]["saved"][step]
        for fqn, tensor in net.state_dict().items():
            assert torch.equal(tensor, expected[f"model/{fqn}"]), fqn
        if with_optimizer:
            names = {id(p): n for n, p in net.named_parameters()}
            for p, per_param in optimizer.state.items():
                for key, value in per_param.items():
                    assert torch.equal(value, expected[f"optimizer0/{names[id(p)]}/{key}"])
            assert optimizer.param_groups[0]["lr"] == two_processes[saved_by][0]["saved_lrs"][step]
        assert state["lightning"]["global_step"] == step and state["lightning"]["epoch"] == 1


def test_bcp_tools_verify_and_export_a_lightning_checkpoint(root, two_processes):
    from safetensors.torch import load_file

    from bcp.cli import main

    path = f"{root}/ddp_plugin/epoch=1.ckpt"
    assert main(["verify", path]) == 0
    assert main(["export", path, "--to", "safetensors", f"{root}/exported"]) == 0
    exported = load_file(f"{root}/exported/model.safetensors")
    expected = two_processes["ddp_plugin"][0]["saved"][2 * STEPS_PER_EPOCH[2]]
    assert exported.keys() == {k[len("model/"):] for k in expected if k.startswith("model/")}
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[f"model/{name}"]), name


def test_a_ddp_run_switches_to_bcp_from_its_torch_checkpoint(two_processes, back_to_one):
    step = 2 * STEPS_PER_EPOCH[2]
    resumed = back_to_one["torch_file_to_plugin"]
    assert_resumed_from(resumed, two_processes["ddp_torch"][0]["saved"][step], step)
    assert resumed["final"]["global_step"] == step + STEPS_PER_EPOCH[1]
    assert "plugins=[BCPCheckpointIO()]" in back_to_one["torch_file_into_strategy"]


def test_clear_errors_when_a_resume_cannot_work(back_to_one):
    assert "keyed by parameter index" in back_to_one["index_keyed_into_fsdp2"]
    assert "BCPDDPStrategy" in back_to_one["index_keyed_into_fsdp2"]
    assert "holds no optimizer state" in back_to_one["weights_only_resume"]


def records(path: str, op: str) -> list[OpRecord]:
    return [OpRecord.from_json(r) for r in read_records(path) if r["op"] == op]


def test_metrics_records_carry_each_strategys_topology(root, two_processes):
    """BCPDDPStrategy: the rank in the checkpoint's group as ``dp``; BCPModelParallelStrategy: the
    rank's coordinates on its device mesh, for the saves and for the resumes' loads."""
    [ddp] = records(f"{root}/bcp_ddp/explicit.ckpt", "save")
    assert [(r.rank, r.topology, r.local_rank) for r in ddp.ranks] == [(0, {"dp": 0}, 0), (1, {"dp": 1}, 1)]
    fsdp2_mesh = [{"dp": 0, "tp": 0}, {"dp": 1, "tp": 0}]  # data_parallel_size=2, tensor_parallel_size=1
    tp_mesh = [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}]  # data_parallel_size=1, tensor_parallel_size=2
    assert [r.topology for r in records(f"{root}/mp2/last.ckpt", "save")[-1].ranks] == fsdp2_mesh
    assert [r.topology for r in records(f"{root}/tp/last.ckpt", "save")[-1].ranks] == tp_mesh
    # explicit.ckpt was resumed twice, by ddp_to_fsdp2 then ddp_to_tp: one record per resume (the
    # read of Lightning's metadata before the state is a step of it, not recorded on its own)
    assert [[r.topology for r in load.ranks] for load in records(f"{root}/bcp_ddp/explicit.ckpt", "load")] == [
        fsdp2_mesh, tp_mesh]
