"""AWS Signature Version 4 for S3 requests, from the public specification, with the standard library.

Only what the multipart client needs: header-based signing of one request. A large body is not
hashed (``UNSIGNED-PAYLOAD``, which S3 accepts): hashing every part would cost a pass over the data.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from urllib.parse import quote

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@dataclass(frozen=True)
class Credentials:
    """Static S3 credentials: keys and, for temporary ones, the session token."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def encode_path(key_path: str) -> str:
    """The request path as S3 expects it in both the request line and the signature: every byte
    percent-encoded except the unreserved characters and ``/`` (S3 does not encode it twice)."""
    return quote(key_path, safe="/")


def encode_query(query: Mapping[str, str]) -> str:
    """The canonical query string: parameters sorted by name, names and values fully encoded."""
    return "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in sorted(query.items()))


def payload_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def sign(method: str, host: str, path: str, query: Mapping[str, str], credentials: Credentials,
         region: str, content_hash: str, now: datetime | None = None) -> dict[str, str]:
    """The headers that sign the request (``Authorization``, ``x-amz-date``, ``x-amz-content-sha256``
    and, for temporary credentials, ``x-amz-security-token``); ``host`` goes in as the ``Host``
    header, ``path`` already encoded by :func:`encode_path`."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": host, "x-amz-content-sha256": content_hash, "x-amz-date": stamp}
    if credentials.session_token:
        headers["x-amz-security-token"] = credentials.session_token
    names = sorted(headers)
    canonical = "\n".join([method, path, encode_query(query),
                           "".join(f"{n}:{headers[n].strip()}\n" for n in names), ";".join(names), content_hash])
    scope = f"{stamp[:8]}/{region}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{payload_hash(canonical.encode())}"
    key = f"AWS4{credentials.secret_access_key}".encode()
    for step in (stamp[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, step.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={credentials.access_key_id}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    headers["Host"] = headers.pop("host")
    return headers
