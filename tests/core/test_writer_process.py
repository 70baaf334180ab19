"""The writer process of asynchronous saves: it writes what the training process staged in shared
memory, the values of the call; a writer process that dies fails its save, which commits nothing,
and the next save starts a new one; abandoning a save stops it; ``bcp.shutdown()`` ends it;
storages another process cannot reach are written from threads. Each fault here is real: the
writer process is stopped and killed with signals."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import bcp
from bcp.engine.shared_memory import shared_memory_available
from bcp.engine.writer_jobs import Abandon, WriteJob
from bcp.engine.writer_process import WriterProcess
from bcp.storage.local import LocalStorage
from bcp.integration import runtime
from process_checks import gone

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="no shared memory by descriptor here")


@pytest.fixture(autouse=True)
def _released():
    """Each test leaves no writer process and no staging buffers to the tests after it."""
    yield
    bcp.shutdown()


def _state(fill: float, tensors: int = 8) -> dict:
    return {f"t{i}": torch.full((1 << 18,), fill + i) for i in range(tensors)}


def _expected(fill: float, tensors: int = 8) -> dict:
    return _state(fill, tensors)


def _loaded(path, generation: int | None = None, tensors: int = 8) -> dict:
    out = {f"t{i}": torch.empty(1 << 18) for i in range(tensors)}
    bcp.load(path, {"model": out}, generation=generation)
    return out


def _writer() -> int:
    """The running writer process's id (a first asynchronous save starts it)."""
    pid = runtime().background.writer_pid()
    assert pid is not None and pid != os.getpid()
    return pid


def test_the_writer_process_writes_the_values_of_the_call(tmp_path):
    state = _state(1.0)
    bcp.save(tmp_path, {"model": state}, async_save=True).wait()
    pid = _writer()
    os.kill(pid, signal.SIGSTOP)  # nothing reaches storage until it runs again
    try:
        handle = bcp.save(tmp_path, {"model": state}, async_save=True, io_threads=2)
        for tensor in state.values():
            tensor.fill_(-7.0)  # training goes on, changing every tensor the save holds
        time.sleep(0.5)
        assert not handle.done()  # the files are the writer process's to write
    finally:
        os.kill(pid, signal.SIGCONT)
    handle.wait()
    assert _writer() == pid  # kept for the next save
    loaded = _loaded(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in _expected(1.0).items())


def _committed_then_writer_stopped(path) -> int:
    """Generation 1 committed (fill 1.0); the writer process then stopped (SIGSTOP): its id."""
    bcp.save(path, {"model": _state(1.0)}, async_save=True).wait()
    pid = _writer()
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_a_writer_process_killed_mid_save_fails_it_and_nothing_is_committed(tmp_path):
    pid = _committed_then_writer_stopped(tmp_path)
    handle = bcp.save(tmp_path, {"model": _state(2.0)}, async_save=True)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(bcp.StorageError, match=rf"writer process \(pid {pid}\) was killed by signal 9 .*not committed"):
        handle.wait()
    assert not (tmp_path / "gen-00000002").exists()  # the failed generation removed whole
    loaded = _loaded(tmp_path)  # the previous generation is still the latest
    assert all(torch.equal(loaded[k], v) for k, v in _expected(1.0).items())
    bcp.save(tmp_path, {"model": _state(3.0)}, async_save=True).wait()  # a new writer process
    assert _writer() != pid
    loaded = _loaded(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in _expected(3.0).items())


def test_an_abandoned_save_stops_the_writer_process_and_is_removed(tmp_path, monkeypatch):
    # The real messages, each noted once sent: the stopped writer process is let go on only once
    # its job and then the abandon request wait in its socket (fixed sleeps lost the race on a
    # loaded machine, and a request sent before the job finds no job to stop).
    sent = {WriteJob: threading.Event(), Abandon: threading.Event()}
    send = WriterProcess._send

    def send_and_note(process: WriterProcess, message, fds=()) -> None:
        send(process, message, fds)
        if type(message) in sent:
            sent[type(message)].set()

    pid = _committed_then_writer_stopped(tmp_path)
    monkeypatch.setattr(WriterProcess, "_send", send_and_note)
    handle = bcp.save(tmp_path, {"model": _state(2.0, tensors=32)}, async_save=True, io_threads=2)
    assert sent[WriteJob].wait(30)
    stopper = threading.Thread(target=bcp.shutdown, kwargs={"abandon": True})
    stopper.start()
    assert sent[Abandon].wait(30)
    os.kill(pid, signal.SIGCONT)
    stopper.join(30)
    with pytest.raises(bcp.SaveAbandonedError):
        handle.wait()
    assert gone(pid)  # shutdown ends the writer process
    assert not (tmp_path / "gen-00000002").exists()
    loaded = _loaded(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in _expected(1.0).items())


def test_a_save_abandoned_just_before_its_job_reaches_the_writer_process_is_not_committed(tmp_path, monkeypatch):
    # The abandon request goes out (and the idle writer process drops it) between the save's last
    # look at the request and the moment its job is sent: the save must still not commit.
    bcp.save(tmp_path, {"model": _state(1.0)}, async_save=True).wait()  # generation 1; the writer process idle
    abandon_sent = threading.Event()
    send = WriterProcess._send

    def abandon_first(process: WriterProcess, message, fds=()) -> None:
        if isinstance(message, WriteJob) and not abandon_sent.is_set():
            threading.Thread(target=bcp.shutdown, kwargs={"abandon": True}).start()
            assert abandon_sent.wait(30)
        send(process, message, fds)
        if isinstance(message, Abandon):
            abandon_sent.set()

    monkeypatch.setattr(WriterProcess, "_send", abandon_first)
    handle = bcp.save(tmp_path, {"model": _state(2.0)}, async_save=True, io_threads=1)
    with pytest.raises(bcp.SaveAbandonedError):
        handle.wait()
    assert not (tmp_path / "gen-00000002").exists()
    loaded = _loaded(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in _expected(1.0).items())


def test_a_save_abandoned_after_its_last_piece_is_written_is_not_committed(tmp_path, monkeypatch):
    bcp.save(tmp_path, {"model": _state(1.0)}, async_save=True, async_writer="threads").wait()
    lane = runtime().background
    write_file = LocalStorage.write_file

    def abandon_once_written(storage: LocalStorage, name: str, chunks) -> None:
        write_file(storage, name, chunks)
        if "gen-00000002" in name and not lane.abandon.is_set():  # the save's one data file, complete
            threading.Thread(target=bcp.shutdown, kwargs={"abandon": True}).start()
            assert lane.abandon.wait(30)

    monkeypatch.setattr(LocalStorage, "write_file", abandon_once_written)
    handle = bcp.save(tmp_path, {"model": _state(2.0)}, async_save=True, async_writer="threads", io_threads=1)
    with pytest.raises(bcp.SaveAbandonedError, match="after its files were written, before its commit"):
        handle.wait()
    assert not (tmp_path / "gen-00000002").exists()
    loaded = _loaded(tmp_path)
    assert all(torch.equal(loaded[k], v) for k, v in _expected(1.0).items())


def test_shutdown_ends_the_writer_process_and_a_later_save_starts_another(tmp_path):
    bcp.save(tmp_path, {"model": _state(1.0)}, async_save=True).wait()
    pid = _writer()
    bcp.shutdown()
    assert gone(pid) and runtime().background.writer_pid() is None
    bcp.save(tmp_path, {"model": _state(4.0)}, async_save=True).wait()
    assert _writer() != pid


def test_memory_storage_and_the_threads_setting_write_from_threads(tmp_path):
    bcp.shutdown()  # no writer process left from an earlier test
    state = _state(5.0)
    bcp.save("memory://writer-test/ckpt", {"model": state}, async_save=True).wait()
    bcp.save(tmp_path, {"model": state}, async_save=True, async_writer="threads").wait()
    assert runtime().background.writer_pid() is None
    for path in ("memory://writer-test/ckpt", tmp_path):
        loaded = _loaded(path)
        assert all(torch.equal(loaded[k], v) for k, v in _expected(5.0).items())


def test_an_unknown_writer_setting_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(bcp.CheckpointError, match="async_writer must be 'process' or 'threads', not 'gpu'"):
        bcp.save(tmp_path, {"model": _state(1.0)}, async_save=True, async_writer="gpu")
    assert not os.path.exists(tmp_path / "gen-00000001")
