"""No code from a checkpoint folder runs on ``load_state`` (one process, a real CPU Accelerator).

Objects registered with ``register_for_checkpointing`` are stored in bcp's safe encoding, not in
accelerate's pickled ``custom_checkpoint_<i>.pkl``. The files accelerate still writes (scheduler,
RNG states) and the ``.pkl`` files of folders written by accelerate's own engine are read with
``weights_only=True``: a pickle that would run code (here: create a marker file) is refused with
``bcp.UnsafeCheckpointError`` naming the folder and the file, and the marker never appears.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import bcp
import bcp.tools
from accelerate_helpers import Counter, session
from hostile_pickle import TouchesMarker


def _save(engine: str, folder: pathlib.Path, value: int) -> None:
    with session(engine) as accelerator:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        accelerator.register_for_checkpointing(Counter(value))
        accelerator.prepare(model, optimizer, scheduler)
        accelerator.save_state(str(folder))


def _load(folder: pathlib.Path) -> int:
    with session("bcp") as accelerator:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        counter = Counter(0)
        accelerator.register_for_checkpointing(counter)
        accelerator.prepare(model, optimizer, scheduler)
        accelerator.load_state(str(folder))
        return counter.value


def test_registered_objects_are_stored_by_bcp_not_pickled(tmp_path):
    folder = tmp_path / "ckpt"
    _save("bcp", folder, 5)
    assert not list(folder.rglob("custom_checkpoint_*"))
    assert bcp.tools.open_checkpoint(str(folder)).read_object("custom_0") == {"value": 5}
    assert _load(folder) == 5


def test_hostile_custom_object_of_an_accelerate_folder_is_refused(tmp_path):
    folder, marker = tmp_path / "ckpt", tmp_path / "marker"
    _save("accelerate", folder, 5)
    torch.save({"value": TouchesMarker(marker)}, folder / "custom_checkpoint_0.pkl")
    with pytest.raises(bcp.UnsafeCheckpointError, match="custom_checkpoint_0.pkl") as refused:
        _load(folder)
    assert str(folder) in str(refused.value) and "Unsupported global" in str(refused.value)
    assert not marker.exists()


def test_hostile_scheduler_file_of_a_bcp_folder_is_refused(tmp_path):
    folder, marker = tmp_path / "ckpt", tmp_path / "marker"
    _save("bcp", folder, 5)
    (scheduler,) = folder.glob("accelerate-*/scheduler.bin")
    torch.save({"last_epoch": TouchesMarker(marker)}, scheduler)
    with pytest.raises(bcp.UnsafeCheckpointError, match=scheduler.parent.name) as refused:
        _load(folder)
    assert str(folder) in str(refused.value)
    assert not marker.exists()
