"""Files of a checkpoint replaced by things that are not regular files: a FIFO
(opening or reading one blocks forever), a directory, a device that never ends (/dev/zero), a
symbolic link leading outside the checkpoint. Loading and verifying must fail with a
``CheckpointError`` naming the file, never hang or read without bound. Each case runs in a capped
child process (``CappedChild``), so a hang is cut off and an unbounded read fails there.

Guards past defects: a FIFO in place of ``manifest.json``, ``COMMITTED`` or a data file hung load and
verify forever, a directory raised ``IsADirectoryError``, ``/dev/zero`` grew the process by gigabytes
until ``MemoryError``, and a data file linked outside the checkpoint was followed."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import bcp
from bcp.tools.verify import verify_checkpoint
from hostile_forge import GEN, CappedChild, empty_state, make_checkpoint, outcome

DATA = "data/00000-00.bin"
HANG_LIMIT_S = 60


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    os.mkdir(path)


def _zero_device(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is


def _can_make_devices(tmp: Path) -> bool:
    try:
        _zero_device(tmp / "probe")
        with open(tmp / "probe", "rb") as f:
            return f.read(4) == b"\0" * 4
    except OSError:
        return False


REPLACEMENTS = {"fifo": _fifo, "directory": _directory, "device": _zero_device}


@pytest.fixture(scope="module")
def child():
    with CappedChild() as worker:
        yield worker


@pytest.mark.parametrize("replacement", sorted(REPLACEMENTS))
@pytest.mark.parametrize("victim", ["manifest.json", "COMMITTED", "shard_table.bin", DATA])
def test_a_file_replaced_by_a_non_regular_file_fails_clearly(tmp_path, child, victim, replacement):
    if replacement == "device" and not _can_make_devices(tmp_path):
        pytest.skip("cannot create a device node here (needs root and a filesystem without nodev)")
    ckpt = make_checkpoint(tmp_path / "ckpt")
    target = ckpt / GEN / victim
    os.remove(target)
    REPLACEMENTS[replacement](target)
    loaded, verified = child.call(_load_and_verify, str(ckpt), timeout=HANG_LIMIT_S)
    name = Path(victim).name
    assert loaded.split(":")[0] in ("CorruptCheckpointError", "StorageError", "CheckpointNotCommittedError"), loaded
    assert name in loaded, loaded
    if victim == DATA:  # the metadata is sound: verify opens the checkpoint and reports the file
        assert verified.startswith("problems:") and name in verified, verified
    else:
        assert verified.split(":")[0] in ("CorruptCheckpointError", "CheckpointNotCommittedError"), verified


def test_a_data_file_linked_outside_the_checkpoint_is_not_followed(tmp_path, child):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    data = ckpt / GEN / DATA
    outside = tmp_path / "elsewhere.bin"
    shutil.copyfile(data, outside)  # identical bytes: only the link itself is wrong
    os.remove(data)
    os.symlink(outside, data)
    loaded, verified = child.call(_load_and_verify, str(ckpt), timeout=HANG_LIMIT_S)
    assert loaded.startswith("StorageError") and "00000-00.bin" in loaded, loaded
    assert verified.startswith("problems:") and "00000-00.bin" in verified, verified


def _load_and_verify(path: str) -> tuple[str, str]:
    """In the child: the outcome of ``bcp.load`` and of ``verify_checkpoint``."""
    loaded = outcome(lambda: bcp.load(path, empty_state()))
    report: list = []
    verified = outcome(lambda: report.append(verify_checkpoint(path)))
    if report:
        verified = "problems: " + "; ".join(p.message for p in report[0].problems) if report[0].problems else "ok"
    return loaded, verified
