"""S3 multipart uploads made of separate requests, so that a failed part can be sent again alone.

obstore (the rest of the S3 backend) runs a whole multipart upload inside one call and has no
per-part API; the four calls of an upload (CreateMultipartUpload, UploadPart,
CompleteMultipartUpload, AbortMultipartUpload) go through the store's botocore client instead
(:mod:`bcp.storage.s3_connection`: the same credentials, endpoint, addressing and CA bundle), each
holding one of the store's request slots.

It retries nothing: :class:`MultipartUpload` is driven, and each of its steps retried, by
:class:`bcp.storage.retry.RetryingStorage`.
"""

from __future__ import annotations

from collections.abc import Sequence

from bcp.storage.parted_writes import joined
from bcp.storage.s3_connection import S3Connection, S3RequestError

MIN_PART_BYTES = 5 << 20
"""S3's smallest part (every part but the last)."""


class MultipartUpload:
    """One file as an S3 multipart upload: :meth:`begin`, then :meth:`send` every part (in any order,
    up to ``parallel`` at once, each as it is cut from the writer's stream), then :meth:`finish`;
    :meth:`abort` if it cannot finish. Each step is one request, safe to repeat: a part sent again
    replaces itself."""

    def __init__(self, connection: S3Connection, key: str) -> None:
        self._connection, self._key = connection, key
        self.parallel = connection.slots.limit  # the store's cap bounds the parts in flight
        self._sent: dict[int, dict[str, str]] = {}
        self._sizes: dict[int, int] = {}
        self._checksum = connection.upload_params.get("ChecksumAlgorithm")
        self._upload_id: str | None = None
        self._finish_tries = 0

    def _call(self, operation: str, where: str, **params: object) -> dict:
        return self._connection.call(operation, where, Key=self._key, **self._connection.request_params, **params)

    def _where(self, what: str) -> str:
        return f"{what} {self._connection.url(self._key)}"

    def begin(self) -> None:
        # A retry after a lost reply starts a second upload; the first one is left incomplete (a
        # bucket lifecycle rule for incomplete multipart uploads removes such leftovers).
        reply = self._call("create_multipart_upload", self._where("CreateMultipartUpload"),
                           **self._connection.upload_params)
        self._upload_id = reply["UploadId"]

    def send(self, index: int, body: Sequence[memoryview]) -> None:
        data = joined(body)  # here, on the sending thread: botocore sends one bytes in one write
        extra = {"ChecksumAlgorithm": self._checksum} if self._checksum else {}
        reply = self._call("upload_part", self._where(f"UploadPart {index + 1}"), UploadId=self._upload_id,
                           PartNumber=index + 1, Body=data, **extra)
        part = {"PartNumber": index + 1, "ETag": reply["ETag"]}
        if self._checksum:
            part[f"Checksum{self._checksum}"] = reply[f"Checksum{self._checksum}"]
        self._sent[index], self._sizes[index] = part, len(data)

    def finish(self) -> None:
        self._finish_tries += 1
        try:
            self._call("complete_multipart_upload", self._where("CompleteMultipartUpload"), UploadId=self._upload_id,
                       MultipartUpload={"Parts": [self._sent[i] for i in sorted(self._sent)]})
        except S3RequestError as exc:
            # an earlier try whose reply was lost completed the upload: the object is there, whole
            if exc.code == "NoSuchUpload" and self._finish_tries > 1 and self._completed():
                return
            raise

    def abort(self) -> None:
        if self._upload_id is not None:
            self._call("abort_multipart_upload", self._where("AbortMultipartUpload"), UploadId=self._upload_id)

    def _completed(self) -> bool:
        try:
            reply = self._call("head_object", self._where("HeadObject"))
        except S3RequestError:
            return False
        return reply.get("ContentLength") == sum(self._sizes.values())
