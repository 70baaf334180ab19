"""A memory tier's asynchronous saves stage in place: each rank's pieces are copied into its data
file of the new generation (a staging file mapped in the saving process, hard-linked into the
generation), not into the staging pool's buffers. On real gloo ranks (2 ranks as 2 nodes, a peer
copy each): the pool allocates nothing and no writer process starts, each data file a rank wrote is
the very file it has mapped, loads are bitwise (from the node's own files and from a peer's copy),
and the files and bytes in the node folders are the same after 10 saves and after 40. Tensors in
accelerator memory (a simulated accelerator) are copied into the files through the pinned chunks.
A staging file takes a new save only once its generation let go of it. A save that fails midway (a tmpfs that fills up while it is written) leaves the committed
generation loadable, and the next save commits."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import bcp
from bcp.engine.staging_files import StagingFiles
from bcp.integration import reset_runtime, runtime
from models import assert_bitwise, build, full_state, rank, train
from simulated_accelerator import QUEUED, REGISTERED, TO_HOST, SimulatedAccelerator

NODES = ["a", "b"]


def _tier(root: str, **keywords) -> bcp.MemoryTier:
    return bcp.MemoryTier(local_dir=os.path.join(root, "tier"), nodes=NODES, **keywords)


def _node_folder(root: str, node: str) -> Path:
    return Path(root) / "tier" / f"node-{node}"


def _census(folder: Path) -> tuple[int, int, list[str]]:
    """The node folder's files (distinct inodes), the bytes they occupy, and its generations."""
    inodes = {}
    for path in folder.rglob("*"):
        if path.is_file():
            stat = path.stat()
            inodes[stat.st_ino] = stat.st_blocks * 512
    return len(inodes), sum(inodes.values()), sorted(p.name for p in folder.glob("gen-*"))


def _blocks(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def _mapped_inodes() -> set[int]:
    """The inodes of the files this process has mapped."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/") and fields[4] != "0":
                found.add(int(fields[4]))
    return found


def save_every_step(root: str, saves: int) -> dict:
    """Train and save to the tier after every step (overlapped on odd steps); what the process and
    its node folder hold after save 10 and after the last, and the state of the last save."""
    bcp.shutdown()  # this rank's process starts without staging buffers or files
    model, optimizer = build("fsdp2", seed=0)
    seen = {}
    folder = _node_folder(root, NODES[rank()])
    for step in range(1, saves + 1):
        train(model, optimizer, range(step, step + 1))
        handle = bcp.save(_tier(root), {"model": model, "optimizer": optimizer, "extra_state": {"step": step}},
                          async_save=True, overlap=step % 2 == 1)
        if step in (10, saves):
            handle.wait()
            pool = runtime().buffers
            own = folder / (sorted(p.name for p in folder.glob("gen-*"))[-1]) / "data" / f"{rank():05d}-00.bin"
            seen[step] = {"census": _census(folder), "pool_bytes": pool.allocated_bytes, "own_bytes": own.stat().st_size,
                          "staging_files": pool.files.file_count(), "writer_pid": runtime().background.writer_pid(),
                          "own_links": own.stat().st_nlink, "own_mapped": own.stat().st_ino in _mapped_inodes()}
    seen["state"] = full_state(model, optimizer)
    bcp.shutdown()
    return seen


def load_tier(root: str) -> tuple[dict, int, str, int]:
    model, optimizer = build("fsdp2", seed=7)
    train(model, optimizer, range(50, 51))  # different values everywhere, optimizer state included
    state = {"model": model, "optimizer": optimizer, "extra_state": {"step": -1}}
    result = bcp.load(_tier(root), state)
    return full_state(model, optimizer), state["extra_state"]["step"], result.source, result.stats.received_bytes


def test_saves_stage_in_the_generation_files_and_memory_stays_flat(ranks, tmp_path):
    seen = ranks(2).run(save_every_step, str(tmp_path), 40)
    for node, (rank_seen, other) in zip(NODES, (seen, seen[::-1])):
        after_10, after_40 = rank_seen[10], rank_seen[40]
        for figures in (after_10, after_40):
            assert figures["pool_bytes"] == 0 and figures["writer_pid"] is None  # the staging pool is unused
            assert figures["own_links"] == 2 and figures["own_mapped"], figures  # the data file is the mapped file
            # The committed generation (its 4 records, its file and the peer's copy, as large) and at
            # most two more staging files (saves in flight), after 10 saves as after 40.
            assert figures["staging_files"] <= 3, figures
            files, nbytes, generations = figures["census"]
            assert files <= 4 + 1 + 3 and nbytes <= 4 * 4096 + (1 + 3) * _blocks(figures["own_bytes"]), figures
            assert len(generations) == 1  # older generations were dropped as newer ones committed
        assert_bitwise(rank_seen["state"], other["state"])  # FSDP2: the whole state, gathered, is one
    loaded = ranks(2).run(load_tier, str(tmp_path))
    for state, step, source, fetched in loaded:
        assert_bitwise(seen[0]["state"], state)
        assert step == 40 and source == "memory" and fetched == 0
    shutil.rmtree(_node_folder(str(tmp_path), "b"))  # node b replaced: its rank loads node a's copy
    for rank_, (state, step, source, fetched) in enumerate(ranks(2).run(load_tier, str(tmp_path))):
        assert_bitwise(seen[0]["state"], state)
        assert step == 40 and source == "memory" and (fetched > 0) == (rank_ == 1)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of 3 MiB (a real file system that fills up), where the test may mount one."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    yield mount
    bcp.shutdown()
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_save_that_fills_the_tmpfs_midway_leaves_the_committed_generation_loadable(small_tmpfs):
    root = str(small_tmpfs)
    tier = bcp.MemoryTier(local_dir=os.path.join(root, "tier"), nodes=["a"])
    weights = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: two generations' pieces fit in 3 MiB
    bcp.save(tier, {"model": {"w": weights}, "extra_state": {"blob": b"first"}}, async_save=True).wait()
    # The pieces of the second save fit beside the first's; its 4 MiB value, written after them in
    # the background, does not: the tmpfs refuses it (ENOSPC).
    with pytest.raises(bcp.CheckpointError, match="No space left on device"):
        bcp.save(tier, {"model": {"w": weights + 1}, "extra_state": {"blob": bytes(4 << 20)}}, async_save=True).wait()
    state = {"model": {"w": torch.zeros_like(weights)}, "extra_state": {"blob": None}}
    assert bcp.load(tier, state).generation == 1
    assert torch.equal(state["model"]["w"], weights) and state["extra_state"]["blob"] == b"first"
    # The failed save's file went back to the staging files: the next save fits and commits.
    bcp.save(tier, {"model": {"w": weights + 2}, "extra_state": {"blob": b"third"}}, async_save=True).wait()
    assert bcp.load(tier, state).generation == 3
    assert torch.equal(state["model"]["w"], weights + 2) and state["extra_state"]["blob"] == b"third"
    # Pieces that do not fit at all: the save fails at the call, naming the tier; nothing changes.
    with pytest.raises(bcp.StorageError, match="cannot stage generation 4 in the node's folder: No space left"):
        bcp.save(tier, {"model": {"w": torch.zeros(1 << 20)}}, async_save=True)
    assert bcp.load(tier, state).generation == 3 and torch.equal(state["model"]["w"], weights + 2)


def test_tensors_in_accelerator_memory_are_copied_into_the_generation_files(tmp_path):
    accelerator = SimulatedAccelerator()
    reset_runtime(accelerator, chunk_bytes=1 << 20)
    try:
        tier = bcp.MemoryTier(local_dir=str(tmp_path / "tier"), nodes=["a"])
        state = {"w": torch.randn(3 << 18), "b": torch.arange(1000, dtype=torch.int64)}
        accelerator.adopt(*state.values())
        for step in range(3):
            state["w"].add_(1)
            expected = {name: tensor.clone() for name, tensor in state.items()}
            bcp.save(tier, {"model": state}, async_save=True).wait()
        assert accelerator.of(QUEUED, TO_HOST) and not accelerator.of(REGISTERED)  # device copies; nothing page-locked
        assert runtime().buffers.allocated_bytes == 0
        out = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        assert bcp.load(tier, {"model": out}).generation == 3
        assert_bitwise(expected, out)
    finally:
        bcp.shutdown()
        accelerator.close()


def test_a_staging_file_is_reused_only_once_its_generation_let_go_of_it(tmp_path):
    staging, generations = tmp_path / "staging", tmp_path / "generations"
    generations.mkdir()
    files = StagingFiles()
    first = files.take(str(staging), 0, 4096, str(generations / "1.bin"))
    first.tensor.fill_(1)
    files.give_back(first)
    second = files.take(str(staging), 0, 4096, str(generations / "2.bin"))  # generation 1 still links the first
    assert second is not first and (generations / "1.bin").read_bytes() == bytes([1]) * 4096
    files.give_back(second)
    (generations / "1.bin").unlink()  # generation 1 retired
    assert files.take(str(staging), 0, 4096, str(generations / "3.bin")) is first
    assert files.take(str(staging), 0, 4096, str(generations / "4.bin"), limit=2) is None  # both hold a generation
    # A restarted process of the same rank (this one killed: nothing cleared) removes the names its
    # predecessor left; the generations that link them keep their bytes.
    restarted = StagingFiles()
    fresh = restarted.take(str(staging), 0, 4096, str(generations / "5.bin"))
    assert sorted(p.name for p in staging.iterdir()) == ["rank-00000-0.bin"]
    assert (generations / "3.bin").stat().st_nlink == 1 and (generations / "3.bin").read_bytes() == bytes([1]) * 4096
    assert os.stat(fresh.path).st_ino == (generations / "5.bin").stat().st_ino != (generations / "3.bin").stat().st_ino
    restarted.clear()
    assert not list(staging.iterdir()) and (generations / "5.bin").exists()


def test_staging_files_whose_names_were_removed_are_all_let_go(tmp_path):
    # The node's folder deleted under a process (a replaced node): every file it held there leaves
    # its list at the next take, the second as well as the first.
    staging, generations = tmp_path / "staging", tmp_path / "generations"
    generations.mkdir()
    files = StagingFiles()
    held = [files.take(str(staging), 0, 4096, str(generations / f"{n}.bin")) for n in range(3)]
    for file in held:
        files.give_back(file)
    for file in held[:2]:
        os.unlink(file.path)
    assert files.file_count() == 3
    files.take(str(staging), 0, 4096, str(generations / "3.bin"), limit=1)
    assert files.file_count() == 1
    files.clear()
