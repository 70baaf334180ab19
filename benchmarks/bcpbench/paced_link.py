"""An emulated network link on 127.0.0.1: a TCP proxy that relays bytes both ways at no more than
``mb_per_s`` megabytes per second per direction (all connections sharing it, as one process's share
of a NIC), so that a loopback S3 server is reached as over a network where bytes cost time.

It paces, it does not model latency or loss: each direction takes its bytes from one budget that
refills at the set rate, in pieces of at most ``PIECE`` bytes. It runs in a process of its own, as
a network card works beside the client: relaying in the measured process would take its CPU time
and its GIL (a relay thread waiting up to the 5 ms switch interval for it while the writer threads
compress), slowing the link exactly while a compressed save codes."""

from __future__ import annotations

import socket
import subprocess
import sys
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
    """Listens on 127.0.0.1 (``endpoint``), in a child process, and relays each connection to the
    ``upstream`` URL's host and port, requests paced by one :class:`Pacer` and answers by another."""

    def __init__(self, upstream: str, mb_per_s: float) -> None:
        self.mb_per_s = mb_per_s
        self._process = subprocess.Popen([sys.executable, __file__, upstream, str(mb_per_s)],
                                         stdout=subprocess.PIPE, text=True)
        port = self._process.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"the paced link exited with {self._process.wait()} before listening")
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self._process.kill()
        self._process.wait()


def serve(upstream: str, mb_per_s: float) -> None:
    """The link itself: prints its port, then relays until killed."""
    target = urlsplit(upstream)
    up, down = Pacer(mb_per_s * 1e6), Pacer(mb_per_s * 1e6)
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        server = socket.create_connection((target.hostname, target.port))
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_relay, args=(client, server, up), daemon=True).start()
        threading.Thread(target=_relay, args=(server, client, down), daemon=True).start()


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


if __name__ == "__main__":
    serve(sys.argv[1], float(sys.argv[2]))
