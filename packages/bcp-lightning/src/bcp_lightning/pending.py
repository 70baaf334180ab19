"""The saves a ``BCPCheckpointIO`` has started and not yet seen committed, by checkpoint path.

A save counts from the moment the plugin is called, not from when bcp returns its handle: under
Lightning's ``AsyncCheckpointIO`` the plugin saves on the wrapper's thread while Lightning removes
and loads checkpoints on the training thread, and a removal must not pull a checkpoint's folder
from under the save that is writing it.
"""

from __future__ import annotations

import atexit
import threading

import bcp


class PendingSave:
    """One save: running until ``bcp.save`` returns, then its handle until committed."""

    def __init__(self) -> None:
        self._returned = threading.Event()
        self._handle: bcp.SaveHandle | None = None

    def returned(self, handle: bcp.SaveHandle | None) -> None:
        """``bcp.save`` returned ``handle`` (None: it raised, to its own caller)."""
        self._handle = handle
        self._returned.set()

    def done(self) -> bool:
        return self._returned.is_set() and (self._handle is None or self._handle.done())

    def wait_snapshot(self) -> None:
        """Block until the save's copy of the state is complete (``bcp.SaveHandle.wait_snapshot``)."""
        self._returned.wait()
        if self._handle is not None:
            self._handle.wait_snapshot()

    def wait(self) -> None:
        """Block until committed; raise if the background part of the save failed."""
        self._returned.wait()
        if self._handle is not None:
            self._handle.wait()


class PendingSaves:
    """Thread-safe record of ``PendingSave``s by path; waited for at interpreter exit."""

    def __init__(self) -> None:
        self._by_path: dict[str, list[PendingSave]] = {}
        self._lock = threading.Lock()
        self._waits_at_exit = False

    def __getstate__(self) -> dict:
        """Pending saves belong to the process that started them: a copy (a pickled model whose
        trainer holds the plugin, a spawned process) starts with none, and with its own lock."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def start(self, path: str) -> PendingSave:
        """Record a save to ``path`` before it touches storage."""
        save = PendingSave()
        with self._lock:
            self._by_path.setdefault(path, []).append(save)
            if not self._waits_at_exit:
                atexit.register(self.wait)
                self._waits_at_exit = True
        return save

    def reap(self) -> None:
        """Forget finished saves, raising the first failure among them: a failed asynchronous save
        then raises at the next save, not only at teardown."""
        with self._lock:
            done = [(path, s) for path, saves in self._by_path.items() for s in saves if s.done()]
            for path, save in done:
                self._forget(path, save)
        for _, save in done:
            save.wait()

    def wait(self, path: str | None = None) -> None:
        """Block until the saves to ``path`` (or all) are committed; raise the first failure."""
        with self._lock:
            paths = [path] if path is not None else list(self._by_path)
            saves = [(p, s) for p in paths for s in self._by_path.get(p, [])]
        try:
            for _, save in saves:
                save.wait()
        finally:
            with self._lock:
                for p, save in saves:
                    self._forget(p, save)

    def wait_snapshots(self) -> None:
        """Block until every pending save's copy of the state is complete."""
        with self._lock:
            saves = [save for saves in self._by_path.values() for save in saves]
        for save in saves:
            save.wait_snapshot()

    def _forget(self, path: str, save: PendingSave) -> None:
        saves = self._by_path.get(path, [])
        if save in saves:
            saves.remove(save)
        if not saves:
            self._by_path.pop(path, None)
