"""S3 and S3-compatible object stores (MinIO, SeaweedFS, Ceph RGW, ...).

Two maintained clients share one configuration (:mod:`bcp.storage.s3_connection`): botocore resolves
credentials, endpoint, region and CA bundle the way the AWS SDKs do; obstore (Rust's
``object_store`` under a thin Python layer: requests outside the GIL on a pooled keep-alive HTTP
client, conditional put, ranged reads) sends small files, commit markers, reads and listings, signed
with botocore's credentials; botocore's S3 client sends the parts of large files, because obstore
runs a whole multipart upload inside one call and a failed part would cost the whole file.

``S3Objects`` issues each operation once; ``S3Storage`` is what users name: the same, retried
(neither client retries on its own: its retries would be neither logged nor counted). A file larger
than one part is handed to the retrying layer as a :class:`~bcp.storage.s3_multipart.MultipartUpload`
whose parts are sent as the writer produces them and retried one by one. Every request holds one of the store's request slots
(``max_requests``, shared by every storage of the store in the process).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

from bcp.errors import StorageError
from bcp.storage.names import child_names, flat_bytes, join_key, split_url
from bcp.storage.parted_writes import joined, part_bodies
from bcp.storage.range_reads import RangeReads, cut_views, request_spans
from bcp.storage.retry import RetryingStorage, RetryPolicy
from bcp.storage.s3_connection import MAX_REQUESTS, S3RequestError, S3Settings, connect
from bcp.storage.s3_multipart import MIN_PART_BYTES, MultipartUpload

PART_BYTES = 16 << 20
"""Multipart part size and about the size of one ranged GET (by default); large enough that per-request overhead is
small, small enough that many parts of one file travel in parallel."""
STREAM_PIECE_BYTES = 1 << 20
"""The pieces a streamed GET's body is handed over in: a compressed checksum chunk's stored bytes
or less, so a chunk can be decoded soon after its last byte arrives."""

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_TLS = re.compile(r"certificate|UnknownIssuer|handshake", re.IGNORECASE)


class S3Objects(RangeReads):
    """The objects under ``s3://bucket/prefix``, one request (or one multipart upload) per operation,
    with no retries of its own: :class:`S3Storage` retries, so that every retry is seen and counted.

    Options left out come from the standard AWS sources (see :mod:`bcp.storage.s3_connection`):
    ``endpoint_url`` (else ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``/the profile's), ``region``
    (else ``AWS_REGION``/``AWS_DEFAULT_REGION``/the profile's, else ``us-east-1``), ``profile`` (else
    ``AWS_PROFILE``), static keys (else botocore's credential chain), ``ca_bundle`` (else
    ``AWS_CA_BUNDLE``/the profile's), ``addressing_style`` (``"path"`` or ``"virtual"``).
    ``part_bytes`` is the multipart part size (at least S3's 5 MiB minimum) and about the size of
    one ranged GET; ``max_requests`` caps
    the requests this process keeps in flight to the store."""

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None,
                 profile: str | None = None, access_key_id: str | None = None, secret_access_key: str | None = None,
                 session_token: str | None = None, ca_bundle: str | None = None, addressing_style: str | None = None,
                 timeout_s: float = 60.0, part_bytes: int = PART_BYTES, max_requests: int = MAX_REQUESTS) -> None:
        bucket, self._prefix = split_url(url, "s3", "bucket")
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes={part_bytes}: S3 parts are at least {MIN_PART_BYTES} bytes")
        self.root = url.rstrip("/")
        self.part_bytes = part_bytes
        """The multipart part size (``PartedWrites``)."""
        settings = S3Settings(
            endpoint_url=endpoint_url, region=region, profile=profile, access_key_id=access_key_id,
            secret_access_key=secret_access_key, session_token=session_token, ca_bundle=ca_bundle,
            addressing_style=addressing_style, timeout_s=timeout_s, max_requests=max_requests)
        try:
            import botocore.exceptions
            import obstore
        except ImportError:
            raise ImportError("s3:// needs obstore and botocore: pip install 'bcp-core[s3]'") from None
        try:
            self.connection = connect(bucket, settings)
        except (botocore.exceptions.BotoCoreError, OSError) as exc:  # an unknown profile, an unreadable CA file
            raise StorageError(f"cannot set up S3 access: {exc}", path=self.root) from exc

        self._ob = obstore
        self._store = self.connection.store
        # obstore raises the builtin FileNotFoundError for a 404 on some calls, its own type on others
        self._not_found = (FileNotFoundError, obstore.exceptions.NotFoundError)

    def parted_upload(self, name: str) -> MultipartUpload:
        """A file larger than one part as a multipart upload whose parts are retried one by one."""
        return MultipartUpload(self.connection, self._key(name))

    def _key(self, name: str) -> str:
        return join_key(self._prefix, name)

    @contextlib.contextmanager
    def _request(self, name: str, requests: int = 1) -> Iterator[None]:
        """Holds ``requests`` of the store's request slots and turns obstore's errors into the Storage
        protocol's: a 404 is ``FileNotFoundError``, a range past the end (416) ``EOFError``, an untrusted
        certificate a permanent ``S3RequestError`` naming the endpoint, anything else an
        ``S3RequestError`` with a one-line message (obstore appends a many-line debug dump)."""
        self.connection.credentials()  # none found: fail now, plainly, rather than inside obstore
        try:
            with self.connection.slots.take(requests):
                yield
        except self._not_found:
            raise FileNotFoundError(2, "no such object", f"{self.root}/{name}") from None
        except self._ob.exceptions.BaseError as exc:
            text = str(exc)
            status = _STATUS.search(text)
            code = _CODE.search(text)
            if status and status.group(1) == "416":
                raise EOFError(f"{self.root}/{name}: range starts past the end of the object") from None
            summary = text.split("\n\nDebug source", 1)[0].split(": <?xml", 1)[0]
            if not status and _TLS.search(text):
                raise self.connection.tls_failure(f"{self.root}/{name}", summary) from exc
            raise S3RequestError(f"{summary}{f' ({code.group(1)})' if code else ''}",
                                 int(status.group(1)) if status else None, code and code.group(1)) from exc

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        """One PUT for a file of one part; a larger one (only when this class is used unretried:
        :class:`S3Storage` sends it through :meth:`parted_upload`) as obstore's multipart upload."""
        bodies = part_bodies(chunks, self.part_bytes)
        first, last = next(bodies)
        if last:  # a multipart upload costs 3 requests more
            with self._request(name):
                self._ob.put(self._store, self._key(name), joined(first), use_multipart=False)
            return
        parallel = self.connection.slots.limit
        with self._request(name, parallel):
            self._ob.put(self._store, self._key(name), (joined(body) for body in chain([first], (body for body, _ in bodies))),
                         chunk_size=self.part_bytes, max_concurrency=parallel)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        errors = self._ob.exceptions
        try:
            with self._request(name):
                self._ob.put(self._store, self._key(name), bytes(data), mode="create", use_multipart=False)
            return True
        except S3RequestError as exc:
            if isinstance(exc.__cause__, (errors.AlreadyExistsError, errors.PreconditionError)):
                return False
            raise

    def read_range(self, name: str, offset: int, nbytes: int) -> list[Any]:
        """Ranged GETs of about one part each, in parallel, as many at once as the store's request
        cap lets one call hold."""
        return self._get(name, request_spans(offset, nbytes, self.part_bytes))

    def read_views(self, name: str, offset: int, sizes: Sequence[int]) -> list[memoryview]:
        """As :meth:`read_range`, cut into one view per size: a view inside one GET is a slice of its
        buffer, a view across two GETs is joined (a copy)."""
        return cut_views(self._get(name, request_spans(offset, sum(sizes), self.part_bytes)), sizes,
                         lambda end: f"{self.root}/{name}: file ends before byte {offset + end}")

    def read_streamed(self, name: str, offset: int, dest: memoryview, arrived: Callable[[int], None]) -> bool:
        """One ranged GET into ``dest``, ``arrived(n)`` called as its body comes in (in pieces of at
        least ``STREAM_PIECE_BYTES``); False for a range that :meth:`read_range` would fetch in
        several GETs at once (longer than a part, or across a part's end where that adds no GET)."""
        nbytes = dest.nbytes
        if not nbytes or len(request_spans(offset, nbytes, self.part_bytes)) != 1:
            return False
        filled = 0
        with self._request(name):
            result = self._ob.get(self._store, self._key(name), options={"range": (offset, offset + nbytes)})
            for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES):
                view = flat_bytes(memoryview(piece))
                if filled + view.nbytes > nbytes:
                    raise S3RequestError(f"{self.root}/{name}: the server sent more than the {nbytes} bytes asked for",
                                         None, None)
                dest[filled: filled + view.nbytes] = view
                filled += view.nbytes
                arrived(filled)
        if filled < nbytes:
            raise EOFError(f"{self.root}/{name}: file ends before byte {offset + nbytes}")
        return True

    def _get(self, name: str, spans: list[tuple[int, int]]) -> list[Any]:
        """One ranged GET per ``(start, end)`` span, each holding one of the store's request slots
        while it runs, in parallel on the store's fetch threads: a call never waits for as many free
        slots as it has spans (several callers asking for several ranges at once would then take
        turns, each leaving slots idle), so the store's cap is kept full as long as there is work."""

        def one(span: tuple[int, int]) -> Any:
            with self._request(name):
                return self._ob.get_range(self._store, self._key(name), start=span[0], end=span[1])

        if len(spans) == 1:
            return [one(spans[0])]
        return list(self.connection.fetches.map(one, spans))

    def read_bytes(self, name: str) -> bytes:
        with self._request(name):
            return self._ob.get(self._store, self._key(name)).bytes().to_bytes()

    def exists(self, name: str) -> bool:
        try:
            with self._request(name):
                self._ob.head(self._store, self._key(name))
            return True
        except FileNotFoundError:  # not an object; maybe a "directory": a prefix with objects below
            with self._request(name):
                return bool(self._list(self._key(name), limit_one=True))

    def size(self, name: str) -> int:
        with self._request(name):
            return self._ob.head(self._store, self._key(name))["size"]

    def list_dir(self, prefix: str) -> list[str]:
        key = self._key(prefix)
        with self._request(prefix):
            listing = self._ob.list_with_delimiter(self._store, key or None)
        keys = [o["path"] for o in listing["objects"]] + [f"{p}/" for p in listing["common_prefixes"]]
        return child_names(keys, key)

    def delete_tree(self, prefix: str) -> None:
        key = self._key(prefix)
        with self._request(prefix):
            objects = self._list(key) + ([key] if key else [])
            self._ob.delete(self._store, objects)  # deleting an absent key is not an error on S3
            # Filer-backed stores (SeaweedFS) keep a "directory" entry ``dir/`` that outlives its
            # objects and would still be listed; plain S3 has none, and deleting absent keys is free.
            folders = {f"{k[:i]}/" for k in objects for i in range(len(key), len(k)) if k[i] == "/"}
            if key:
                folders.add(f"{key}/")
            self._ob.delete(self._store, sorted(folders, key=len, reverse=True))

    def _list(self, key: str, limit_one: bool = False) -> list[str]:
        found: list[str] = []
        for batch in self._ob.list(self._store, f"{key}/" if key else None, chunk_size=1 if limit_one else 1000):
            found.extend(o["path"] for o in batch)
            if limit_one and found:
                break
        return found

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, S3RequestError) and exc.transient


class S3Storage(RetryingStorage):
    """``s3://bucket/prefix`` with transient errors retried under ``retry``: what ``bcp.save`` and
    ``bcp.load`` use for an ``s3://`` URL. Pass one explicitly to set options in code (those of
    :class:`S3Objects`), e.g. ``bcp.save(S3Storage("s3://ckpt/run", endpoint_url="https://minio:9000",
    ca_bundle="/etc/ssl/minio-ca.pem"), state)``; ``part_bytes=`` sets a smaller multipart part size
    (tests use 5 MiB parts), ``max_requests=`` the cap on this process's requests in flight to the store."""

    def __init__(self, url: str, *, retry: RetryPolicy | None = None, **options: Any) -> None:
        super().__init__(S3Objects(url, **options), retry)
