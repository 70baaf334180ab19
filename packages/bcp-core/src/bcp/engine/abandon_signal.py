"""The background lane's abandon request: an event that a thread blocked in ``select`` can wait for
too. A save waiting for its writer process so sleeps until the answer or an abandon request,
instead of waking on a timer to look for one (each waking takes the interpreter lock from the
training thread)."""

from __future__ import annotations

import socket
import threading


class AbandonSignal(threading.Event):
    """A ``threading.Event`` that is also readable (``fileno``) while set. Its socket pair is opened
    by the first ``fileno`` and closed by ``close``; a later ``fileno`` opens a new one, so the lane
    that owns it can be closed and used again without holding descriptors in between."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._pair: tuple[socket.socket, socket.socket] | None = None  # (readable end, waking end)

    def fileno(self) -> int:
        with self._lock:
            if self._pair is None:
                self._pair = socket.socketpair()
                if self.is_set():
                    self._pair[1].send(b"!")
            return self._pair[0].fileno()

    def set(self) -> None:
        with self._lock:
            if self._pair is not None and not self.is_set():
                self._pair[1].send(b"!")  # one byte, read by clear(): readable until then
            super().set()

    def clear(self) -> None:
        with self._lock:
            if self._pair is not None and self.is_set():
                self._pair[0].recv(1)
            super().clear()

    def close(self) -> None:
        """Close the socket pair (nobody may be waiting on it); the event keeps its state."""
        with self._lock:
            pair, self._pair = self._pair, None
        for end in pair or ():
            end.close()
