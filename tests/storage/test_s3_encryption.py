"""Server-side encryption on S3, against the real SeaweedFS server, set as the AWS SDKs' environment
sets it: SSE-S3 (keys held by the server) and SSE-C (a key the client sends with every request). A
large file goes part by part through the fault proxy (each part encrypted, retried on its own) and
a checkpoint saves and loads back; the server reports every object encrypted. SSE-KMS is not
tested: SeaweedFS serves it only with a KMS configured, and the test server has none."""

from __future__ import annotations

import base64
import os

import bcp
import botocore.exceptions
import botocore.session
import pytest
import s3_test_server as seaweedfs
import torch
from bcp.storage import S3Storage
from s3_part_uploads import PART, write_through_faults

CUSTOMER_KEY = os.urandom(32)


@pytest.fixture(params=["sse-s3", "sse-c"])
def encryption(request, s3_env, monkeypatch) -> str:
    """The encryption the test's uploads ask for, set in the environment."""
    if request.param == "sse-s3":
        monkeypatch.setenv("AWS_SERVER_SIDE_ENCRYPTION", "AES256")
    else:
        monkeypatch.setenv("AWS_SERVER_SIDE_ENCRYPTION", "sse-c")
        monkeypatch.setenv("AWS_SSE_CUSTOMER_KEY_BASE64", base64.b64encode(CUSTOMER_KEY).decode())
    return request.param


def _client(s3_server):
    """A botocore client of the server with the test keys: the server's view, not through bcp."""
    return botocore.session.Session().create_client(
        "s3", endpoint_url=s3_server.endpoint, region_name="us-east-1", aws_access_key_id=seaweedfs.ACCESS_KEY,
        aws_secret_access_key=seaweedfs.SECRET_KEY)


def _head(s3_server, key: str, customer_key: bytes | None = None) -> dict:
    extra = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": customer_key} if customer_key else {}
    return _client(s3_server).head_object(Bucket=seaweedfs.BUCKET, Key=key, **extra)


def _assert_encrypted(s3_server, key: str, encryption: str) -> None:
    if encryption == "sse-s3":
        assert _head(s3_server, key)["ServerSideEncryption"] == "AES256"
    else:
        assert _head(s3_server, key, CUSTOMER_KEY)["SSECustomerAlgorithm"] == "AES256"
        with pytest.raises(botocore.exceptions.ClientError):  # without the key, the object is not served
            _head(s3_server, key)


def test_a_large_file_is_encrypted_part_by_part_through_faults(s3_server, s3_url, storage_log, encryption):
    write_through_faults(s3_server, s3_url, storage_log)
    _assert_encrypted(s3_server, f"{s3_url.split('/', 3)[3]}/shard.bin", encryption)


def test_an_encrypted_checkpoint_saves_and_loads_bitwise(s3_server, s3_url, encryption):
    model, fresh = torch.nn.Linear(2048, 1536), torch.nn.Linear(2048, 1536)  # a data file of several parts
    bcp.save(S3Storage(s3_url, part_bytes=PART), {"model": model})
    bcp.load(s3_url, {"model": fresh})
    for name, value in model.state_dict().items():
        assert torch.equal(value.view(torch.int32), fresh.state_dict()[name].view(torch.int32)), name
    prefix = s3_url.split("/", 3)[3]
    data = [k for k in _keys(s3_server, prefix) if "/data/" in k]
    assert data
    for key in data:
        _assert_encrypted(s3_server, key, encryption)


def _keys(s3_server, prefix: str) -> list[str]:
    listing = _client(s3_server).list_objects_v2(Bucket=seaweedfs.BUCKET, Prefix=prefix)
    return [o["Key"] for o in listing.get("Contents", [])]
