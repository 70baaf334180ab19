"""An emulated network link on 127.0.0.1: a TCP proxy that relays bytes both ways at no more than
``mb_per_s`` megabytes per second per direction (all connections sharing it, as one process's share
of a NIC), so that a loopback S3 server is reached as over a network where bytes cost time.

It paces, it does not model latency or loss: each direction takes its bytes from one budget that
refills at the set rate, in pieces of at most ``PIECE`` bytes."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

PIECE = 256 << 10  # bytes relayed per step: small against a second's budget, large for few syscalls


class Pacer:
    """A budget of bytes per second: ``take(n)`` returns once the link has carried the bytes before
    it and ``n`` more at the rate."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / self.bytes_per_s
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))


class PacedLink:
    """Listens on 127.0.0.1 (``endpoint``) and relays each connection to the ``upstream`` URL's host
    and port, requests paced by one :class:`Pacer` and answers by another."""

    def __init__(self, upstream: str, mb_per_s: float) -> None:
        target = urlsplit(upstream)
        self.upstream, self.mb_per_s = (target.hostname, target.port), mb_per_s
        self._up, self._down = Pacer(mb_per_s * 1e6), Pacer(mb_per_s * 1e6)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="paced-link", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_relay, args=(client, server, self._up), daemon=True).start()
            threading.Thread(target=_relay, args=(server, client, self._down), daemon=True).start()


def _relay(source: socket.socket, sink: socket.socket, pacer: Pacer) -> None:
    """Bytes from ``source`` to ``sink`` at the pacer's rate until either side closes."""
    try:
        while data := source.recv(PIECE):
            pacer.take(len(data))
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
