"""The S3 fixtures every test folder can use (``conftest.py`` imports them): one real SeaweedFS S3
server per session, started on first use (``s3_test_server``) and killed at the end, serving HTTP
and HTTPS (with a certificate authority made for the session, ``s3_tls``), with an STS that issues
temporary credentials, to the test keys and to the holders of ID tokens of an OpenID Connect
issuer run by the session (``s3_oidc``)."""

from __future__ import annotations

import uuid

import pytest
import s3_test_server as seaweedfs
import s3_tls
from s3_oidc import OidcIssuer


@pytest.fixture(scope="session")
def oidc_issuer():
    """The session's OpenID Connect issuer (the one the S3 server trusts for web identity tokens)."""
    issuer = OidcIssuer()
    yield issuer
    issuer.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory, oidc_issuer):
    """One real SeaweedFS S3 server for the session's tests."""
    tls = s3_tls.make(str(tmp_path_factory.mktemp("s3-tls")))
    server = seaweedfs.start(str(tmp_path_factory.mktemp("seaweedfs")), tls=tls, sts=True, oidc=oidc_issuer)
    yield server
    seaweedfs.stop(server)


@pytest.fixture
def s3_url(s3_server):
    """A fresh, empty ``s3://`` prefix in the test bucket."""
    return f"s3://{seaweedfs.BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The standard AWS variables pointing at the test server, so plain ``s3://`` URLs reach it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.env()
