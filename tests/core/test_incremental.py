"""Incremental saves (``bcp.save(..., incremental=True)``): a save writes only the boxes whose bytes
the newest committed generation at the path does not store already, and every generation still
loads on its own, into any layout, bitwise."""

from __future__ import annotations

import json

import pytest
import torch

import bcp
from bcp.tools import open_checkpoint
from lora_models import SAVES, assert_round_trip, build_lora, frozen_nbytes, save_fine_tuning
from models import assert_bitwise, full_state, train

@pytest.mark.parametrize("kind,async_save", [("fsdp2", False), ("ddp", True)])
def test_a_frozen_base_saved_three_times_on_two_ranks_loads_bitwise_on_one_and_three(ranks, tmp_path, kind,
                                                                                       async_save):
    path = str(tmp_path / "ckpt")
    saves = ranks(2).run(save_fine_tuning, kind, path, async_save)
    versions = {g: open_checkpoint(path, generation=g).manifest.version for g in range(1, SAVES + 1)}
    assert versions == {1: 1, 2: 3, 3: 3}
    assert_round_trip(ranks, path, saves)


def test_later_generations_list_the_first_generations_files_and_never_chain(tmp_path):
    model, optimizer = build_lora("plain", seed=1)
    for save in range(4):
        train(model, optimizer, range(save, save + 1))
        bcp.save(tmp_path, {"model": model, "optimizer": optimizer}, incremental=True, keep_generations=4)
    files = {g: json.loads((tmp_path / f"gen-{g:08d}" / "manifest.json").read_text())["files"] for g in (1, 2, 3, 4)}
    assert files[1] == ["data/00000-00.bin"]
    for generation in (2, 3, 4):  # each names the file where the base's bytes lie, never a generation in between
        assert files[generation] == ["data/00000-00.bin", "gen-00000001/data/00000-00.bin"]


def _fine_tuning(path, **options) -> tuple:
    model, optimizer = build_lora("plain", seed=1)
    state = {"model": model, "optimizer": optimizer}
    train(model, optimizer, range(1))
    bcp.save(path, state, incremental=True, **options)
    return model, optimizer, state


class _Checksummed:
    """Counts the bytes the reuse decision checksums (``planning.reuse`` reads live bytes only there)."""

    def __init__(self, monkeypatch) -> None:
        import bcp.planning.reuse as reuse

        self.nbytes = 0
        real = reuse.chunk_crcs

        def counting(data, chunk):
            self.nbytes += data.nbytes
            return real(data, chunk)
        monkeypatch.setattr(reuse, "chunk_crcs", counting)


def test_an_untouched_frozen_base_is_not_read_and_trained_tensors_are_written_unread(tmp_path, monkeypatch):
    model, optimizer, state = _fine_tuning(tmp_path)
    train(model, optimizer, range(1, 2))
    checksummed = _Checksummed(monkeypatch)
    handle = bcp.save(tmp_path, state, incremental=True)
    frozen = frozen_nbytes(model)
    assert handle.stats.reused_bytes == frozen  # the whole base, and nothing trained
    # one chunk of each frozen tensor (the 1.6 MB weight: one 1 MiB chunk of its two), nothing of the rest
    assert checksummed.nbytes == (1 << 20) + sum(p.numel() * 4 for n, p in model.named_parameters()
                                                 if not p.requires_grad and n != "base2.weight")
    assert handle.stats.bytes < frozen / 10
    live, _ = build_lora("plain", seed=5)
    bcp.load(tmp_path, {"model": live}, strict=False)
    assert_bitwise(model.state_dict(), live.state_dict())


def _change(parameter: torch.nn.Parameter, how: str) -> None:
    new = parameter.detach() * 2 + 1
    if how == "in place":
        with torch.no_grad():
            parameter.mul_(2).add_(1)
    elif how == "data assigned":
        parameter.data = new
    elif how == "set_":
        with torch.no_grad():
            parameter.set_(new.clone())
    elif how == "behind the version counter":  # .data shares the memory, not the counter
        parameter.data.copy_(new)


@pytest.mark.parametrize("how", ["in place", "data assigned", "set_", "behind the version counter"])
def test_a_frozen_parameter_changed_by_the_user_is_written_again(tmp_path, how):
    model, optimizer, state = _fine_tuning(tmp_path)
    weight = model.base2.weight
    seen = (weight._version, weight.untyped_storage().data_ptr())
    _change(weight, how)
    assert (weight._version, weight.untyped_storage().data_ptr()) != seen or how == "behind the version counter"
    handle = bcp.save(tmp_path, state, incremental=True)  # nothing else changed: everything else is reused
    changed = model.base2.weight.numel() * 4
    assert handle.stats.bytes >= changed
    assert handle.stats.reused_bytes == open_checkpoint(tmp_path).manifest.total_tensor_bytes() - changed
    assert torch.equal(bcp.tools.read_tensor(tmp_path, "model/base2.weight"), model.base2.weight)


def test_a_partial_write_behind_the_version_counter_is_caught_when_its_chunk_is_checked(tmp_path):
    """The untouched-frozen signal reads one chunk per save, a different one at each generation: a
    write through ``.data`` to another chunk is missed by that save and caught by a later one;
    ``trust_frozen=False`` checksums every byte and catches it at once."""
    model, optimizer, state = _fine_tuning(tmp_path / "trusted")
    _fine_tuning(tmp_path / "checksummed", trust_frozen=False)
    weight = model.base2.weight
    last = weight.numel() - 1  # in the second chunk; generation 2 checks the first (2 % 2)
    saved = weight.detach().clone()
    weight.data.view(-1)[last] += 1
    bcp.save(tmp_path / "trusted", state, incremental=True)
    bcp.save(tmp_path / "checksummed", state, incremental=True, trust_frozen=False)
    read = bcp.tools.read_tensor
    assert read(tmp_path / "checksummed", "model/base2.weight").view(-1)[last] == weight.view(-1)[last]
    assert torch.equal(read(tmp_path / "trusted", "model/base2.weight"), saved)  # missed
    bcp.save(tmp_path / "trusted", state, incremental=True)  # generation 3 checks the second chunk
    assert torch.equal(read(tmp_path / "trusted", "model/base2.weight"), weight)


def test_unchanged_tensors_outside_frozen_parameters_are_reused_by_their_checksums(tmp_path, monkeypatch):
    model, optimizer, state = _fine_tuning(tmp_path)
    state["buffers"] = {"positions": torch.arange(100_000)}  # a constant tensor of the state, not a parameter
    bcp.save(tmp_path, state, incremental=True)
    checksummed = _Checksummed(monkeypatch)
    handle = bcp.save(tmp_path, state, incremental=True)  # nothing trained: every byte is the base's
    assert handle.stats.reused_bytes == open_checkpoint(tmp_path).manifest.total_tensor_bytes()
    assert handle.stats.bytes < 2000  # only the per-rank values (the optimizer's param groups)
    # the adapters and their optimizer state are read (the buffer's checksums are the plain tensor's own)
    trained = sum(p.numel() * 4 * 3 for p in model.parameters() if p.requires_grad)
    assert checksummed.nbytes >= trained


def test_after_a_restart_the_base_manifest_decides_and_later_saves_remember_again(tmp_path, monkeypatch):
    from bcp.api.runtime import reset_runtime

    model, optimizer, state = _fine_tuning(tmp_path)
    reset_runtime()  # a new process: no memory of the save that wrote the base
    checksummed = _Checksummed(monkeypatch)
    handle = bcp.save(tmp_path, state, incremental=True)
    assert handle.stats.reused_bytes >= frozen_nbytes(model) and checksummed.nbytes >= frozen_nbytes(model)
    checksummed.nbytes = 0
    handle = bcp.save(tmp_path, state, incremental=True)
    assert handle.stats.reused_bytes >= frozen_nbytes(model) and checksummed.nbytes < frozen_nbytes(model) / 2


def test_a_load_between_saves_is_never_taken_for_an_untouched_tensor(tmp_path):
    model, optimizer, state = _fine_tuning(tmp_path, keep_generations=5)
    first = model.base2.weight.detach().clone()
    with torch.no_grad():
        model.base2.weight[0, 0] += 1  # generation 2 stores another first chunk
    bcp.save(tmp_path, state, incremental=True, keep_generations=5)
    bcp.load(tmp_path, {"model": model}, generation=1, strict=False, transactional=False)  # read into the live memory
    assert torch.equal(model.base2.weight, first)
    bcp.save(tmp_path, state, incremental=True, keep_generations=5)
    assert torch.equal(bcp.tools.read_tensor(tmp_path, "model/base2.weight"), first)


def test_an_asynchronous_incremental_save_stages_only_what_it_writes(tmp_path):
    from bcp.api.runtime import runtime

    model, optimizer, state = _fine_tuning(tmp_path)  # synchronous: no host buffer yet
    train(model, optimizer, range(1, 2))
    handle = bcp.save(tmp_path, state, incremental=True, async_save=True)
    handle.wait()
    assert handle.stats.reused_bytes == frozen_nbytes(model)
    assert 0 < runtime().buffers.allocated_bytes < frozen_nbytes(model) / 10
    live, _ = build_lora("plain", seed=5)
    bcp.load(tmp_path, {"model": live}, strict=False)
    assert_bitwise(model.state_dict(), live.state_dict())


def test_the_oldest_generation_stays_while_a_kept_one_refers_to_its_bytes(tmp_path):
    model, optimizer = build_lora("plain", seed=1)
    state = {"model": model, "optimizer": optimizer}
    expected = {}
    for save in range(1, 5):
        train(model, optimizer, range(save, save + 1))
        bcp.save(tmp_path, state, incremental=True)
        expected[save] = full_state(model, optimizer)
    # generation 2 is gone; 1 is older than the two kept, but they refer to its bytes
    assert _generations(tmp_path) == [1, 3, 4]
    for generation in (1, 3, 4):
        live, live_optimizer = build_lora("plain", seed=2)
        train(live, live_optimizer, range(1))
        bcp.load(tmp_path, {"model": live, "optimizer": live_optimizer}, generation=generation)
        assert_bitwise(expected[generation], full_state(live, live_optimizer))
    assert bcp.tools.verify_checkpoint(tmp_path).ok
    bcp.save(tmp_path, state)  # a whole generation: 4 still refers to 1
    assert _generations(tmp_path) == [1, 4, 5]
    bcp.save(tmp_path, state)
    assert _generations(tmp_path) == [5, 6]


def test_a_save_in_progress_keeps_the_base_it_refers_to(tmp_path):
    """Retention by another writer keeps the base a save in progress named in its claim (and the
    generations that base refers to): the claim is newer than the oldest generation kept."""
    from bcp.api.location import resolve

    def generation(number: int, files: list[str] | None, base: int | None = None) -> None:
        folder = tmp_path / f"gen-{number:08d}"
        folder.mkdir()
        (folder / "CLAIM").write_text(json.dumps({} if base is None else {"base": base}))
        if files is not None:
            (folder / "manifest.json").write_text(json.dumps({"version": 3, "files": files}))
            (folder / "COMMITTED").write_text("{}")

    generation(1, ["data/00000-00.bin"])
    generation(2, ["data/00000-00.bin", "gen-00000001/data/00000-00.bin"])
    generation(3, ["data/00000-00.bin"])  # another writer's, whole
    generation(4, None, base=2)  # an incremental save in progress, based on 2
    generation(5, ["data/00000-00.bin"])
    location = resolve(tmp_path, None, keep_generations=2)
    location.apply_retention(5)  # keeps 3 and 5; 4 may refer to 2, and 2 to 1
    assert _generations(tmp_path) == [1, 2, 3, 4, 5]
    (tmp_path / "gen-00000004" / "CLAIM").write_text("{}")  # a save without a base
    location.apply_retention(5)
    assert _generations(tmp_path) == [3, 4, 5]


def _generations(path) -> list[int]:
    return sorted(int(p.name[4:]) for p in path.iterdir() if p.name.startswith("gen-"))


@pytest.mark.parametrize("version,name", [
    (3, "gen-00000002/data/00000-00.bin"),  # the manifest's own generation, not an earlier one
    (3, "gen-00000007/data/00000-00.bin"),  # a later one
    (3, "gen-00000000/data/00000-00.bin"),  # no generation 0
    (3, "gen-1/data/00000-00.bin"),  # not eight digits
    (3, "gen-00000001/../../../etc/passwd"),
    (3, "gen-00000001/gen-00000001/data/00000-00.bin"),  # a chain
    (3, "/etc/passwd"),
    (2, "gen-00000001/data/00000-00.bin"),  # before version 3 no manifest names another generation's file
])
def test_a_manifest_naming_a_file_that_is_not_an_earlier_generations_is_refused(tmp_path, version, name):
    from hostile_forge import forge

    model, optimizer = build_lora("plain", seed=1)
    for _ in range(2):
        bcp.save(tmp_path, {"model": model}, incremental=True)
    forge(tmp_path, lambda doc: doc.update(version=version, files=[doc["files"][0], name]), gen="gen-00000002")
    with pytest.raises(bcp.CorruptCheckpointError, match="is not a file of an earlier generation|relative paths"):
        open_checkpoint(tmp_path)
    with pytest.raises(bcp.CorruptCheckpointError):
        bcp.tools.verify_checkpoint(tmp_path)


def test_a_bcp_that_reads_only_earlier_versions_refuses_a_version_3_checkpoint(tmp_path, monkeypatch):
    import bcp.layout.manifest as manifest

    model, _ = build_lora("plain", seed=1)
    for _ in range(2):
        bcp.save(tmp_path, {"model": model}, incremental=True)
    monkeypatch.setattr(manifest, "SUPPORTED_VERSIONS", (1, 2))
    with pytest.raises(bcp.FormatVersionError, match="format version 3 is not readable by this bcp"):
        bcp.load(tmp_path, {"model": build_lora("plain", seed=2)[0]})


def test_a_process_remembers_the_saves_of_a_few_paths_only(tmp_path):
    from bcp.planning.reuse_memory import ReuseMemory

    memory = ReuseMemory()
    for path in range(ReuseMemory.PLACES + 3):  # top-k checkpoints: a new path at each save
        for generation in (1, 2, 3, 4):
            memory.remember((f"path-{path}", "channel"), generation, {}, memory.epoch)
            memory.claimed(f"path-{path}", generation, "token")
    assert memory.generations(("path-0", "channel")) == [] and memory.claim_token("path-0", 4) is None
    newest = (f"path-{ReuseMemory.PLACES + 2}", "channel")
    assert memory.generations(newest) == [2, 3, 4] and memory.claim_token(newest[0], 4) == "token"
    memory.remember(newest, 5, {}, memory.epoch - 1)  # seen before a load: not remembered
    assert memory.generations(newest) == [2, 3, 4]
