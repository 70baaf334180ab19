"""S3 over HTTPS against the real SeaweedFS server, whose certificate is signed by a certificate
authority the test session made (``tests/s3_tls.py``): trusted through AWS_CA_BUNDLE or the
``ca_bundle`` option on every path (obstore's requests and botocore's part uploads), refused at once
with a clear error under the wrong authority."""

from __future__ import annotations

import bcp
import pytest
import torch
from bcp.storage import S3Storage
from s3_part_uploads import PART, seven_part_file
from s3_sharded import load_big_sharded, save_big_sharded

ROWS = 6144  # 48 MiB of float32: 24 MiB per rank of two, more than one 16 MiB part


def _https(s3_server, ca: str) -> dict[str, str]:
    return {**s3_server.env(s3_server.https_endpoint), "AWS_CA_BUNDLE": ca}


def test_a_two_rank_save_over_https_loads_resharded_on_three_ranks_with_the_ca_from_aws_ca_bundle(
        ranks, s3_server, s3_url):
    """Each rank's data file (24 MiB) is larger than one part, so the save sends parts over HTTPS."""
    env = _https(s3_server, s3_server.tls.ca)
    ranks(2).run(save_big_sharded, s3_url, env, ROWS)
    assert all(ranks(3).run(load_big_sharded, s3_url, env, ROWS))


def test_the_ca_bundle_option_trusts_the_server_for_part_uploads_and_reads(s3_server, s3_url):
    storage = S3Storage(s3_url, ca_bundle=s3_server.tls.ca, part_bytes=PART,
                        **s3_server.options(s3_server.https_endpoint))
    sent = []
    storage.inner.connection.client.meta.events.register(
        "before-send.s3.UploadPart", lambda request, **_: sent.append(request.url))
    data, views = seven_part_file()
    storage.write_file("shard.bin", views)
    assert storage.read_bytes("shard.bin") == data
    assert len(sent) == 7 and all(url.startswith(s3_server.https_endpoint) for url in sent), sent


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_wrong_ca_fails_at_once_with_a_storage_error_naming_the_endpoint(
        s3_server, s3_url, monkeypatch, storage_log, size):
    """A small file goes through obstore, a large one through botocore's part uploads: both refuse."""
    for name, value in _https(s3_server, s3_server.tls.wrong_ca).items():
        monkeypatch.setenv(name, value)
    storage = S3Storage(s3_url, part_bytes=PART)
    views = [memoryview(b"small")] if size == "small" else seven_part_file()[1]
    with pytest.raises(bcp.StorageError) as failure:
        storage.write_file("shard.bin", views)
    message = str(failure.value)
    assert f"TLS certificate of {s3_server.https_endpoint}" in message and "not trusted" in message, message
    assert s3_server.tls.wrong_ca in message and "attempt 1 (permanent error)" in message, message
    assert not [r for r in storage_log.records if "retrying" in r.getMessage()]


def test_a_save_to_a_plain_url_under_the_wrong_ca_names_the_endpoint(s3_server, s3_url, monkeypatch):
    for name, value in _https(s3_server, s3_server.tls.wrong_ca).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(bcp.StorageError, match=f"TLS certificate of {s3_server.https_endpoint}"):
        bcp.save(s3_url, {"model": torch.nn.Linear(4, 4)})
