"""A loopback HTTP proxy in front of the test S3 server that injects real faults.

Each request is forwarded to the server unless ``fault(method, path)`` picks a fault for it:
``"slowdown"`` answers 503 SlowDown without forwarding, ``"reset"`` resets the connection before
forwarding, ``"reset_after"`` forwards (the server acts) and then resets instead of replying (the
client cannot know whether its request took effect), ``"stall"`` holds the request unanswered for
``stall_s`` seconds and then drops the connection, ``"forbidden"`` answers 403 AccessDenied without
forwarding (as a bucket policy that lets the caller only read), ``"no_such_upload"`` answers 404
NoSuchUpload without forwarding (S3's answer for a multipart upload completed or aborted before;
SeaweedFS completes one twice instead). The proxy counts requests, faults, the
response body bytes it relays and the request body bytes it receives (faulted requests included), so
tests can check how much a load downloaded and how much a save uploaded.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Fault = Callable[[str, str], "str | None"]
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}
_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_NO_SUCH_UPLOAD = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code>'
                   b"<Message>The specified upload does not exist.</Message></Error>")
_ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                  b"<Message>Access Denied</Message></Error>")


class FaultProxy:
    def __init__(self, upstream: str, fault: Fault | None = None, stall_s: float = 5.0) -> None:
        self.stall_s = stall_s
        target = urlsplit(upstream)
        self.upstream = (target.hostname, target.port)
        self.fault: Fault = fault or (lambda method, path: None)
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.get_body_bytes = 0
        self.received_body_bytes = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, address: None  # a reset we made is no error
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset_counts(self) -> None:
        with self.lock:
            self.requests.clear()
            self.faults.clear()
            self.get_body_bytes = 0
            self.received_body_bytes = 0
            self.max_in_flight = 0

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real S3 endpoint
            upstream: http.client.HTTPConnection | None = None

            def log_message(self, *args: object) -> None:  # quiet: pytest shows failures anyway
                pass

            def _any(self) -> None:
                # A request is in flight from its headers until just before its answer goes out: inside
                # the time the client waits for it, so the proxy never counts more than the client sent.
                self.answered = False
                with proxy.lock:
                    proxy.in_flight += 1
                    proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._serve()
                finally:
                    self._answering()

            def _answering(self) -> None:
                if not self.answered:
                    self.answered = True
                    with proxy.lock:
                        proxy.in_flight -= 1

            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.fault(self.command, self.path)
                with proxy.lock:
                    proxy.requests[self.command] += 1
                    proxy.received_body_bytes += len(body)
                    if fault:
                        proxy.faults[fault] += 1
                if fault == "slowdown":
                    return self._reply(503, [("Content-Type", "application/xml")], _SLOWDOWN)
                if fault == "forbidden":
                    return self._reply(403, [("Content-Type", "application/xml")], _ACCESS_DENIED)
                if fault == "no_such_upload":
                    return self._reply(404, [("Content-Type", "application/xml")], _NO_SUCH_UPLOAD)
                if fault == "stall":
                    time.sleep(proxy.stall_s)
                    return self._reset()
                if fault == "reset":
                    return self._reset()
                status, headers, payload = self._forward(body)
                if fault == "reset_after":
                    return self._reset()
                if self.command == "GET":
                    with proxy.lock:
                        proxy.get_body_bytes += len(payload)
                self._reply(status, headers, payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                if self.upstream is None:
                    self.upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                self.upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        self.upstream.putheader(name, value)  # Host unchanged: it is signed
                self.upstream.putheader("Content-Length", str(len(body)))
                self.upstream.endheaders(body)
                response = self.upstream.getresponse()
                payload = response.read()
                headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
                return response.status, headers, payload

            def _reply(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
                self._answering()
                self.send_response_only(status)
                for name, value in headers:
                    self.send_header(name, value)
                if not any(name.lower() == "content-length" for name, _ in headers):
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _reset(self) -> None:
                self._answering()
                # SO_LINGER with a zero timeout makes close() send RST: a real "connection reset by peer"
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

        return Handler
