"""Retrying a storage's transient failures, outside the engine.

``RetryingStorage`` wraps any backend: an operation that fails with a transient error (a 5xx or
SlowDown, a reset connection, a timeout) is tried again after an exponentially growing, jittered
pause until the policy's budget is spent; a permanent error fails at once. Missing files stay
``FileNotFoundError`` and short files ``EOFError`` (the Storage protocol's own signals); every other
final failure is a :class:`bcp.StorageError` naming the URL, the file, the byte range, the attempts
and the cause. Every retry is logged on the ``bcp.storage`` logger and counted in ``stats``.

A large file on a backend that can upload it in parts (:class:`~bcp.storage.parted_writes.PartedWrites`,
S3's multipart upload) is written part by part as the writer produces its bytes, each part its own
retried operation: a transient failure sends that part again, not the whole file.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Protocol, TypeVar

from bcp.errors import StorageError
from bcp.storage.base import Storage
from bcp.storage.parted_writes import PartedUpload, PartedWrites, part_bodies
from bcp.storage.range_reads import StreamedReads, ViewReads

log = logging.getLogger("bcp.storage")
T = TypeVar("T")

_PROTOCOL_SIGNALS = (FileNotFoundError, EOFError)  # the Storage protocol's answers, not failures


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long transient storage errors are retried."""

    max_attempts: int = 10
    """Tries per operation, the first included."""
    first_delay_s: float = 0.1
    """The pause before the second try; each later pause doubles, up to ``max_delay_s``."""
    max_delay_s: float = 5.0
    """The longest single pause."""
    budget_s: float = 120.0
    """No new try starts this long after the first one."""

    def delay(self, attempt: int) -> float:
        """The pause after failed try number ``attempt`` (from 1): full jitter, so that many ranks
        retrying at once spread out instead of hitting the server again in step."""
        return random.uniform(0, min(self.max_delay_s, self.first_delay_s * 2 ** (attempt - 1)))


class RetryStats:
    """Thread-safe counts of one storage's retries and final failures, by cause: the error's ``kind``
    where the backend names one (``"SlowDown"``, ``"HTTP 503"``, ``"no reply"``), else its type."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()

    def count(self, which: Counter[str], cause: BaseException) -> None:
        with self._lock:
            which[getattr(cause, "kind", None) or type(cause).__name__] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"retries": dict(self.retries), "failures": dict(self.failures)}


class Classified(Protocol):
    """A backend that can tell a transient error (worth another try) from a permanent one."""

    def is_transient(self, exc: BaseException) -> bool: ...


class RetryingStorage(Storage):
    """``inner``'s operations, each retried on transient errors under ``policy``."""

    def __init__(self, inner: Storage | Classified, policy: RetryPolicy | None = None) -> None:
        self.inner = inner
        self.root = inner.root
        self.policy = policy or RetryPolicy()
        self.stats = RetryStats()

    def _call(self, what: str, operation: Callable[[], T]) -> T:
        attempt, started = 1, time.monotonic()
        while True:
            try:
                return operation()
            except _PROTOCOL_SIGNALS:
                raise
            except Exception as exc:  # classified below: transient ones are retried, the rest fail now
                transient = _is_transient(self.inner, exc)
                pause = self.policy.delay(attempt)
                spent = time.monotonic() + pause - started
                if not transient or attempt >= self.policy.max_attempts or spent > self.policy.budget_s:
                    self.stats.count(self.stats.failures, exc)
                    kind = "transient error, retry budget spent" if transient else "permanent error"
                    log.error("%s failed on attempt %d (%s%s): %r", what, attempt, kind, _rank_note(), exc)
                    raise StorageError(f"{what} failed on attempt {attempt} ({kind}): {exc}",
                                       path=self.root) from exc
                self.stats.count(self.stats.retries, exc)
                log.warning("%s: attempt %d failed%s, retrying in %.2fs: %r", what, attempt, _rank_note(),
                            pause, exc)
                time.sleep(pause)
                attempt += 1

    def _where(self, name: str, start: int | None = None, nbytes: int | None = None) -> str:
        span = "" if start is None else f" bytes {start}-{start + (nbytes or 0) - 1}"
        return f"{self.root}/{name}{span}"

    def write_file(self, name: str, chunks: Iterable[memoryview]) -> None:
        if not isinstance(self.inner, PartedWrites):
            # A retried write must send the same bytes again, so the stream is drawn once, here; its
            # views point into tensors the saver holds anyway, so this keeps references, not copies.
            views = list(chunks)
            self._call(f"writing {self._where(name)}", lambda: self.inner.write_file(name, views))
            return
        bodies = part_bodies(chunks, self.inner.part_bytes)
        first, last = next(bodies)
        if last:  # one part: one PUT (a multipart upload costs three requests more)
            self._call(f"writing {self._where(name)}", lambda: self.inner.write_file(name, first))
        else:
            self._write_parts(name, self.inner.parted_upload(name), chain([(first, last)], bodies))

    def _write_parts(self, name: str, upload: PartedUpload, bodies: Iterator[tuple[list[memoryview], bool]]) -> None:
        """Begins the upload, sends each part as soon as ``bodies`` cuts it (the caller's thread goes
        on producing the next while up to ``upload.parallel`` are sent), then completes it; aborts it
        on any failure, the stream's own included (an abandoned save), once no part is in flight."""
        self._call(f"starting the upload of {self._where(name)}", upload.begin)
        pool = ThreadPoolExecutor(upload.parallel, thread_name_prefix="bcp-upload-part")
        try:
            sending: set[Future[None]] = set()
            offset = 0
            for index, (body, _) in enumerate(bodies):
                nbytes = sum(view.nbytes for view in body)
                # bounded memory: a part cut while `parallel` are being sent waits here for one of them
                # to end, and the stream is not drawn meanwhile
                sending = _settled(sending, block=len(sending) >= upload.parallel)
                sending.add(pool.submit(self._call, f"writing {self._where(name, offset, nbytes)}",
                                        partial(upload.send, index, body)))
                offset += nbytes
                del body  # held by its send alone while the next part is cut
            while sending:
                sending = _settled(sending, block=True)
            self._call(f"completing the upload of {self._where(name)}", upload.finish)
        except BaseException:
            pool.shutdown(cancel_futures=True)  # no part lands after the abort
            try:  # once: an upload left behind costs storage, but the error to report is the first one
                upload.abort()
            except Exception as exc:  # noqa: BLE001 - logged; the upload's own error is raised
                log.warning("could not abort the upload of %s, leaving its parts to the bucket's lifecycle "
                            "rules: %r", self._where(name), exc)
            raise
        finally:
            pool.shutdown()

    def put_if_absent(self, name: str, data: bytes) -> bool:
        tries = 0

        def attempt() -> bool:
            nonlocal tries
            tries += 1
            created = self.inner.put_if_absent(name, data)
            # A try whose reply was lost may have created the object: finding our own bytes there
            # means that try won, not another writer.
            return created or (tries > 1 and self.inner.read_bytes(name) == data)

        return self._call(f"creating {self._where(name)}", attempt)

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        self._call(f"reading {self._where(name, offset, dest.nbytes)}",
                   lambda: self.inner.read_into(name, offset, dest))

    def read_into_many(self, name: str, offset: int, dests: Sequence[memoryview]) -> None:
        nbytes = sum(d.nbytes for d in dests)
        self._call(f"reading {self._where(name, offset, nbytes)}",
                   lambda: self.inner.read_into_many(name, offset, dests))

    def read_views(self, name: str, offset: int, sizes: Sequence[int]) -> list[memoryview] | None:
        """``inner``'s views of the fetched bytes (:class:`~bcp.storage.range_reads.ViewReads`), or None
        where it has none to hand out."""
        if not isinstance(self.inner, ViewReads):
            return None
        views_of = self.inner
        return self._call(f"reading {self._where(name, offset, sum(sizes))}",
                          lambda: views_of.read_views(name, offset, sizes))

    def read_streamed(self, name: str, offset: int, dest: memoryview, arrived: Callable[[int], None]) -> bool:
        """``inner``'s streamed read (:class:`~bcp.storage.range_reads.StreamedReads`), retried whole;
        False where it has none."""
        if not isinstance(self.inner, StreamedReads):
            return False
        streams = self.inner
        return self._call(f"reading {self._where(name, offset, dest.nbytes)}",
                          lambda: streams.read_streamed(name, offset, dest, arrived))

    def read_bytes(self, name: str) -> bytes:
        return self._call(f"reading {self._where(name)}", lambda: self.inner.read_bytes(name))

    def exists(self, name: str) -> bool:
        return self._call(f"checking {self._where(name)}", lambda: self.inner.exists(name))

    def size(self, name: str) -> int:
        return self._call(f"sizing {self._where(name)}", lambda: self.inner.size(name))

    def list_dir(self, prefix: str) -> list[str]:
        return self._call(f"listing {self._where(prefix)}", lambda: self.inner.list_dir(prefix))

    def delete_tree(self, prefix: str) -> None:
        self._call(f"deleting {self._where(prefix)}", lambda: self.inner.delete_tree(prefix))


def _settled(sending: set[Future[None]], block: bool) -> set[Future[None]]:
    """The sends of ``sending`` still running, after waiting for one to end where ``block``; a send
    that failed for good raises its error (no further part is cut or sent)."""
    done, running = wait(sending, timeout=None if block else 0, return_when=FIRST_COMPLETED)
    for sent in done:
        sent.result()
    return running


def _is_transient(inner: object, exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    classify = getattr(inner, "is_transient", None)
    return bool(classify and classify(exc))


def _rank_note() -> str:
    """``", rank N"`` inside a process group, so a job's merged logs say which rank retried."""
    import torch.distributed as dist

    return f", rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
