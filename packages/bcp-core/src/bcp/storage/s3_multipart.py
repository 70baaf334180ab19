"""S3 multipart uploads made of separate requests, so that a failed part can be sent again alone.

obstore (the rest of the S3 backend) runs a whole multipart upload inside one call and has no
per-part API; this module speaks the few S3 REST calls of a multipart upload itself
(CreateMultipartUpload, UploadPart, CompleteMultipartUpload, AbortMultipartUpload), signed with
SigV4 (:mod:`bcp.storage.sigv4`) over pooled keep-alive ``http.client`` connections, path-style
addressed like obstore's default. Bodies are sent straight from the caller's buffers, unhashed and
uncopied; sockets send outside the GIL, so parts in parallel threads travel in parallel.

It retries nothing: :class:`MultipartUpload` is driven, and each of its steps retried, by
:class:`bcp.storage.retry.RetryingStorage`.
"""

from __future__ import annotations

import bisect
import http.client
import re
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from bcp.storage.sigv4 import UNSIGNED_PAYLOAD, Credentials, encode_path, encode_query, payload_hash, sign

MIN_PART_BYTES = 5 << 20
"""S3's smallest part (every part but the last)."""
_IDLE_S = 4.0
"""A pooled connection idle longer is closed, not reused: servers drop idle keep-alive connections
(S3 after a few seconds to minutes), and a request on a dropped one would fail for nothing."""
_CODE = re.compile(rb"<Code>([^<]+)</Code>")
_UPLOAD_ID = re.compile(rb"<UploadId>([^<]+)</UploadId>")
_TRANSIENT_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"})


class S3RequestError(OSError):
    """A failed S3 request: the HTTP ``status`` (None when no reply came) and the S3 error ``code``."""

    def __init__(self, message: str, status: int | None, code: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    @property
    def kind(self) -> str:
        """The cause in a word, for the retry counts."""
        return self.code or (f"HTTP {self.status}" if self.status else "no reply")

    @property
    def transient(self) -> bool:
        """A 5xx (SlowDown is a 503), a 408/429, a retryable S3 code (a ``RequestTimeout`` is a 400,
        an ``InternalError`` may come inside a 200 reply), or no reply at all (reset, timed out)."""
        return (self.status is None or self.status >= 500 or self.status in (408, 429)
                or self.code in _TRANSIENT_CODES)


class S3Client:
    """Signed requests to one bucket, on connections kept alive and shared by the calling threads."""

    def __init__(self, endpoint: str | None, region: str, bucket: str, credentials: Credentials,
                 timeout_s: float) -> None:
        target = urlsplit(endpoint or f"https://s3.{region}.amazonaws.com")
        if target.scheme not in ("http", "https") or not target.hostname:
            raise ValueError(f"S3 endpoint must be an http:// or https:// URL, not {endpoint!r}")
        self.base = f"{target.scheme}://{target.netloc}"
        self._https = target.scheme == "https"
        self._host, self._port = target.hostname, target.port
        self._netloc = target.netloc.rpartition("@")[2]  # the Host header: host[:port] as written
        self._bucket_path = f"{target.path.rstrip('/')}/{bucket}"
        self._region, self._credentials, self._timeout_s = region, credentials, timeout_s
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return f"{self.base}{encode_path(f'{self._bucket_path}/{key}')}"

    def request(self, method: str, key: str, query: Mapping[str, str], body: Sequence[memoryview] | bytes = b"",
                ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One signed request: the reply's status, headers and body; an error reply or no reply raise
        :class:`S3RequestError`. ``body`` as several buffers is sent one after the other, uncopied."""
        path = encode_path(f"{self._bucket_path}/{key}")
        signed = isinstance(body, bytes)  # small bodies (the part list) are hashed; parts are not
        headers = sign(method, self._netloc, path, query, self._credentials, self._region,
                       payload_hash(body) if signed else UNSIGNED_PAYLOAD)
        headers["Content-Length"] = str(len(body) if signed else sum(v.nbytes for v in body))
        target = f"{path}?{encode_query(query)}" if query else path
        where = f"{method} {self.base}{target}"
        connection = self._take()
        try:
            connection.request(method, target, body=body if signed or body else None, headers=headers)
            reply = connection.getresponse()
            payload = reply.read()
        except ssl.SSLCertVerificationError:
            connection.close()
            raise  # a wrong certificate is no transient fault: fail at once
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise S3RequestError(f"{where}: no reply ({exc!r})", None, None) from exc
        if reply.will_close:
            connection.close()
        else:
            self._give_back(connection)
        code = _CODE.search(payload) if reply.status >= 300 or b"<Error>" in payload[:512] else None
        if reply.status >= 300 or code:
            name = code.group(1).decode() if code else None
            raise S3RequestError(f"{where}: HTTP {reply.status}{f' {name}' if name else ''}", reply.status, name)
        return reply.status, reply.headers, payload

    def _take(self) -> http.client.HTTPConnection:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                connection, since = self._idle.pop()
                if now - since < _IDLE_S:
                    return connection
                connection.close()
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=self._timeout_s)

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append((connection, time.monotonic()))


class MultipartUpload:
    """One file as an S3 multipart upload: :meth:`begin`, then :meth:`send` every part (in any order,
    up to ``parallel`` at once), then :meth:`finish`; :meth:`abort` if it cannot finish. Each step is
    one request, safe to repeat: a part sent again replaces itself."""

    def __init__(self, client: S3Client, key: str, views: Sequence[memoryview], part_bytes: int,
                 parallel: int) -> None:
        self._client, self._key, self._views = client, key, views
        self._starts = [0]
        for view in views:
            self._starts.append(self._starts[-1] + view.nbytes)
        size = self._starts[-1]
        self.parts = [(offset, min(part_bytes, size - offset)) for offset in range(0, size, part_bytes)]
        """``(offset, nbytes)`` of each part in the file."""
        self.parallel = parallel
        self._etags: list[str | None] = [None] * len(self.parts)
        self._upload_id: str | None = None
        self._finish_tries = 0

    def begin(self) -> None:
        # A retry after a lost reply starts a second upload; the first one is left incomplete (a
        # bucket lifecycle rule for incomplete multipart uploads removes such leftovers).
        _, _, payload = self._client.request("POST", self._key, {"uploads": ""})
        found = _UPLOAD_ID.search(payload)
        if not found:
            raise S3RequestError(f"POST {self._client.url(self._key)}?uploads: no UploadId in the reply", 200, None)
        self._upload_id = found.group(1).decode()

    def send(self, index: int) -> None:
        offset, nbytes = self.parts[index]
        _, headers, _ = self._client.request("PUT", self._key, self._query(partNumber=str(index + 1)),
                                             self._slices(offset, nbytes))
        self._etags[index] = headers.get("ETag", "")

    def finish(self) -> None:
        self._finish_tries += 1
        listing = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(etag or '')}</ETag></Part>"
                          for n, etag in enumerate(self._etags, 1))
        body = f"<CompleteMultipartUpload>{listing}</CompleteMultipartUpload>".encode()
        try:
            self._client.request("POST", self._key, self._query(), body)
        except S3RequestError as exc:
            # an earlier try whose reply was lost completed the upload: the object is there, whole
            if exc.code == "NoSuchUpload" and self._finish_tries > 1 and self._completed():
                return
            raise

    def abort(self) -> None:
        if self._upload_id is not None:
            self._client.request("DELETE", self._key, self._query())

    def _query(self, **more: str) -> dict[str, str]:
        return {**more, "uploadId": self._upload_id or ""}

    def _completed(self) -> bool:
        try:
            _, headers, _ = self._client.request("HEAD", self._key, {})
        except S3RequestError:
            return False
        return headers.get("Content-Length") == str(self._starts[-1])

    def _slices(self, offset: int, nbytes: int) -> list[memoryview]:
        """The part's bytes as views into the caller's buffers (a part may span several)."""
        slices, end = [], offset + nbytes
        index = bisect.bisect_right(self._starts, offset) - 1
        while offset < end:
            start = self._starts[index]
            view = self._views[index][offset - start:min(end - start, self._views[index].nbytes)]
            if view.nbytes:
                slices.append(view)
                offset += view.nbytes
            index += 1
        return slices
