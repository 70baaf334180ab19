"""Saving where nothing can be written: the error names the step that failed and is a
``StorageError`` (it used to read "planning the save ... failed: OSError"), and nothing of a
checkpoint appears. The read-only file system is a real one: a tmpfs mounted read-only (the test is
skipped where this process may not mount, saying so)."""

from __future__ import annotations

import subprocess

import pytest
import torch

import bcp


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_save_onto_a_read_only_file_system_names_the_step(read_only_folder):
    path = read_only_folder / "ckpt"
    with pytest.raises(bcp.StorageError, match=r"cannot claim generation 1 \(creating gen-00000001/CLAIM\): "
                                               r"Read-only file system") as raised:
        bcp.save(path, {"model": {"w": torch.ones(4)}})
    assert str(path) in str(raised.value)
    assert not path.exists()
