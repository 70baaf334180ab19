"""Messages between the training process and its writer process over their private socket pair:
a record (``writer_jobs``) as msgpack, with file descriptors (shared memory) passed alongside. Light imports only: the writer process starts
with them alone."""

from __future__ import annotations

import socket
import struct
from typing import Any, Callable, Mapping

import msgpack

from bcp.wire_records import WireRecord

_HEADER = struct.Struct("<QI")  # payload bytes, descriptors passed with the header
MAX_FDS = 64


class PeerGone(EOFError):
    """The other end closed the socket (its process exited), whether or not it had read everything
    sent to it (an end closed with unread data resets the connection)."""


def send(sock: socket.socket, message: WireRecord, fds: list[int] = ()) -> None:
    """Sends ``message`` (and ``fds``); :class:`PeerGone` where the other process has gone."""
    payload = msgpack.packb(message.to_wire(), use_bin_type=True)
    header = _HEADER.pack(len(payload), len(fds))
    try:
        if fds:
            socket.send_fds(sock, [header], list(fds))
        else:
            sock.sendall(header)
        sock.sendall(payload)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerGone(f"the other process closed its end ({exc.strerror})") from None


def receive(sock: socket.socket, read: Callable[[Mapping[str, Any]], Any]) -> tuple[Any, list[int]]:
    """The next message (its record, as ``read`` decodes it) and the descriptors that came with it;
    :class:`PeerGone` at the end."""
    try:
        header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
        if not header:
            raise PeerGone("the other process closed its end")
        header += _exactly(sock, _HEADER.size - len(header))
        size, _ = _HEADER.unpack(header)
        return read(msgpack.unpackb(_exactly(sock, size), raw=False, use_list=True)), fds
    except ConnectionResetError:
        raise PeerGone("the other process closed its end with messages unread") from None


def _exactly(sock: socket.socket, nbytes: int) -> bytes:
    buffer = bytearray(nbytes)
    view, got = memoryview(buffer), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerGone("the other process closed its end mid-message")
        got += n
    return bytes(buffer)
