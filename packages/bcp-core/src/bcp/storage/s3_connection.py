"""One S3 store's clients in this process, set up once from the standard AWS sources.

botocore (the core of the AWS SDK for Python) resolves what a deployment configures, the way the
AWS CLI and boto3 do: credentials through its chain (explicit keys, ``AWS_ACCESS_KEY_ID``/
``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` with the shared config and
credentials files, SSO, web identity tokens (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``),
container credentials, instance metadata), refreshing temporary credentials before they expire,
and the CA bundle (``AWS_CA_BUNDLE``, a profile's ``ca_bundle``). Both clients of a store use that
one resolution: botocore's own S3 client sends multipart uploads part by part (it signs them and
speaks TLS through urllib3), and obstore does everything else, with botocore's credentials as its
credential provider and the same CA bundle as its root certificate.
"""

from __future__ import annotations

import base64
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit

from bcp.storage.request_slots import RequestSlots

MAX_REQUESTS = 8
"""Requests one process keeps in flight to one store, across its files and threads, by default
(measured: see docs/storage.md)."""
_CREDENTIALS_TTL = timedelta(minutes=5)
"""How long obstore keeps a credential before asking again; botocore refreshes temporary
credentials 10 to 15 minutes before they expire, so each one handed out outlives this."""
_TRANSIENT_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"})


class S3RequestError(OSError):
    """A failed S3 request: the HTTP ``status`` (None when no reply came), the S3 error ``code`` and,
    for a failure no retry can mend (an untrusted certificate, no credentials), ``permanent``."""

    def __init__(self, message: str, status: int | None, code: str | None, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.permanent = permanent

    @property
    def kind(self) -> str:
        """The cause in a word, for the retry counts."""
        return self.code or (f"HTTP {self.status}" if self.status else "no reply")

    @property
    def transient(self) -> bool:
        """A 5xx (SlowDown is a 503), a 408/429, a retryable S3 code (a ``RequestTimeout`` is a 400,
        an ``InternalError`` may come inside a 200 reply), or no reply at all (reset, timed out)."""
        return not self.permanent and (self.status is None or self.status >= 500 or self.status in (408, 429)
                                       or self.code in _TRANSIENT_CODES)


@dataclass(frozen=True)
class S3Settings:
    """What a user may set in code; anything left None comes from the standard AWS sources."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    ca_bundle: str | None = None
    """A PEM file of the certificate authorities to trust, instead of ``AWS_CA_BUNDLE`` or the
    profile's ``ca_bundle`` (the system's and certifi's roots when none is set)."""
    addressing_style: str | None = None
    """``"path"`` (``endpoint/bucket/key``) or ``"virtual"`` (``bucket.endpoint/key``); by default
    virtual-hosted on AWS, path-style on any other endpoint (MinIO, SeaweedFS, Ceph RGW)."""
    timeout_s: float = 60.0
    max_requests: int = MAX_REQUESTS

    def __post_init__(self) -> None:
        if self.addressing_style not in (None, "path", "virtual"):
            raise ValueError(f"addressing_style={self.addressing_style!r}: 'path' or 'virtual'")


class S3Connection:
    """A bucket's botocore client (``client``), obstore store (``store``), request cap (``slots``) and
    threads for parallel reads (``fetches``)."""

    def __init__(self, bucket: str, settings: S3Settings) -> None:
        import botocore.config
        import botocore.session

        env = os.environ.get
        session = botocore.session.Session(profile=settings.profile)
        session.register_component("data_loader", _shared_loader(session))
        if settings.access_key_id or settings.secret_access_key:
            session.set_credentials(settings.access_key_id, settings.secret_access_key, settings.session_token)
        profile = session.get_scoped_config()  # raises botocore's ProfileNotFound for an unknown profile
        endpoint = (settings.endpoint_url or env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL")
                    or env("AWS_ENDPOINT") or profile.get("endpoint_url"))
        region = settings.region or env("AWS_REGION") or session.get_config_variable("region") or "us-east-1"
        style = settings.addressing_style or (
            "virtual" if _truthy(env("AWS_VIRTUAL_HOSTED_STYLE_REQUEST")) or not endpoint else "path")
        self.bucket, self.region, self.addressing_style = bucket, region, style
        self.ca_bundle: str | None = settings.ca_bundle or session.get_config_variable("ca_bundle")
        self.slots = RequestSlots(settings.max_requests)
        self.fetches = ThreadPoolExecutor(settings.max_requests, thread_name_prefix="bcp-s3-get")
        """Threads for the ranged GETs of the store's reads, one per request slot: each GET runs on
        its own and waits for one slot, whoever asked for it."""
        self._session = session
        self.client = session.create_client(
            "s3", region_name=region, endpoint_url=endpoint, verify=self.ca_bundle,
            config=botocore.config.Config(
                signature_version="s3v4",
                # parts are not hashed (S3 accepts UNSIGNED-PAYLOAD) and carry no checksum unless the
                # user asks for one (AWS_CHECKSUM_ALGORITHM): each would cost a pass over the data
                s3={"addressing_style": style, "payload_signing_enabled": False},
                request_checksum_calculation="when_required", response_checksum_validation="when_required",
                retries={"total_max_attempts": 1},  # bcp retries, so that every retry is logged and counted
                max_pool_connections=settings.max_requests, connect_timeout=10, read_timeout=settings.timeout_s))
        self.endpoint: str = self.client.meta.endpoint_url
        self.upload_params, self.request_params = _multipart_params(env)
        self.store = _obstore_store(bucket, self.endpoint, region, style, self.ca_bundle, settings.timeout_s,
                                    self._obstore_credentials)

    def url(self, key: str = "") -> str:
        """Where ``key`` is, for messages: the endpoint, the bucket and the key."""
        return f"{self.endpoint.rstrip('/')}/{self.bucket}/{key}"

    def credentials(self) -> Any:
        """botocore's credentials for this store (refreshed by botocore when temporary); a permanent
        :class:`S3RequestError` when the chain finds none or their source refuses them (an STS that
        rejects a web identity token), a transient one when their source does not answer."""
        found = self._session.get_credentials()
        if found is not None:
            try:  # temporary credentials are fetched or refreshed here, where a failure can be classified
                found.get_frozen_credentials()
            except Exception as exc:  # noqa: BLE001 - classified: the source's reply decides a retry
                raise self._classified(exc, f"getting credentials ({found.method}) for {self.endpoint}") from exc
        if found is None:
            raise S3RequestError(
                f"{self.endpoint}: no AWS credentials found (looked for keys in the options, AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE and the shared config and credentials files, a web identity "
                "token, container and instance metadata)", None, "NoCredentials", permanent=True)
        return found

    def _obstore_credentials(self) -> dict[str, Any]:
        frozen = self.credentials().get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": datetime.now(timezone.utc) + _CREDENTIALS_TTL}

    def call(self, operation: str, where: str, **params: Any) -> dict[str, Any]:
        """One botocore S3 operation on the bucket, holding one request slot; botocore's errors become
        :class:`S3RequestError` naming ``where``."""
        method: Callable[..., dict[str, Any]] = getattr(self.client, operation)
        self.credentials()
        with self.slots.take():
            try:
                return method(Bucket=self.bucket, **params)
            except Exception as exc:  # noqa: BLE001 - every botocore failure is classified here
                raise self._classified(exc, where) from exc

    def tls_failure(self, where: str, exc: BaseException) -> S3RequestError:
        trusted = f"the CA bundle {self.ca_bundle}" if self.ca_bundle else "the system's certificate authorities"
        return S3RequestError(f"{where}: the TLS certificate of {self.endpoint} is not trusted by {trusted} "
                              f"(set AWS_CA_BUNDLE or ca_bundle= to the CA that signed it): {exc}",
                              None, "UntrustedCertificate", permanent=True)

    def _classified(self, exc: Exception, where: str) -> Exception:
        from botocore import exceptions as errors

        if isinstance(exc, errors.SSLError):
            return self.tls_failure(where, exc)
        if isinstance(exc, errors.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            reason = exc.response.get("Error", {}).get("Message")
            detail = f"{f' {code}' if code else ''}{f': {reason}' if reason else ''}"
            return S3RequestError(f"{where}: HTTP {status}{detail}", status, code)
        if isinstance(exc, (errors.ConnectionError, errors.HTTPClientError)):  # refused, reset, timed out
            return S3RequestError(f"{where}: no reply ({exc})", None, None)
        if isinstance(exc, errors.BotoCoreError):
            return S3RequestError(f"{where}: {exc}", None, type(exc).__name__, permanent=True)
        return exc


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def _multipart_params(env: Callable[[str], str | None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameters of CreateMultipartUpload, and of every request of an upload, for the object
    settings obstore reads from the environment, so that large files are stored as small ones."""
    create: dict[str, Any] = {}
    every: dict[str, Any] = {}
    encryption = env("AWS_SERVER_SIDE_ENCRYPTION")
    if encryption and encryption.lower() == "sse-c":
        key = base64.b64decode(env("AWS_SSE_CUSTOMER_KEY_BASE64") or "")
        every.update(SSECustomerAlgorithm="AES256", SSECustomerKey=key)
    elif encryption:
        create["ServerSideEncryption"] = encryption
        if env("AWS_SSE_KMS_KEY_ID"):
            create["SSEKMSKeyId"] = env("AWS_SSE_KMS_KEY_ID")
        if env("AWS_SSE_BUCKET_KEY_ENABLED"):
            create["BucketKeyEnabled"] = _truthy(env("AWS_SSE_BUCKET_KEY_ENABLED"))
    if _truthy(env("AWS_REQUESTER_PAYS")) or _truthy(env("AWS_REQUEST_PAYER")):
        every["RequestPayer"] = "requester"
    if env("AWS_CHECKSUM_ALGORITHM"):
        create["ChecksumAlgorithm"] = env("AWS_CHECKSUM_ALGORITHM").upper()
    return create, every


def _obstore_store(bucket: str, endpoint: str, region: str, style: str, ca_bundle: str | None, timeout_s: float,
                   credentials: Callable[[], Mapping[str, Any]]) -> Any:
    import obstore.store

    target = urlsplit(endpoint)
    if style == "virtual":  # obstore takes a virtual-hosted endpoint with the bucket in the host
        endpoint = f"{target.scheme}://{bucket}.{target.netloc}"
    options: dict[str, Any] = {"allow_http": target.scheme == "http", "timeout": f"{timeout_s}s",
                               "connect_timeout": "10s"}
    if ca_bundle:
        with open(ca_bundle, "rb") as pem:
            options["root_certificate"] = pem.read()
    return obstore.store.S3Store(
        bucket, config={"endpoint": endpoint, "region": region, "virtual_hosted_style_request": style == "virtual"},
        client_options=options, retry_config={"max_retries": 0}, credential_provider=credentials)


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader(session: Any) -> Any:
    """One botocore data loader for the process: it caches the parsed S3 service model, the bulk of a
    client's start-up (about half a second on a loaded 2-core machine)."""
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
        return _loader


_connections: dict[tuple, S3Connection] = {}
_connections_lock = threading.Lock()


def connect(bucket: str, settings: S3Settings) -> S3Connection:
    """The process's connection for ``bucket`` with ``settings`` and the current ``AWS_*`` variables,
    made on first use: every storage of one store shares its clients, pools and request cap."""
    key = (bucket, astuple(settings), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _connections_lock:
        found = _connections.get(key)
        if found is None:
            found = _connections[key] = S3Connection(bucket, settings)
        return found
