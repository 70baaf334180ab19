"""S3 multipart uploads whose parts are retried one by one, against a real SeaweedFS server: faults
injected by the loopback proxy cost a resend of the failed part, not of the file; a permanent 403 on
a part fails at once and leaves no object; a checkpoint with multi-part data files round-trips."""

from __future__ import annotations

import bcp
import pytest
import torch
from bcp.storage.s3 import S3Objects
from s3_part_uploads import (PART, part_number, proxied_storage, retry_lines, seven_part_file, stored,
                             write_through_faults)

def test_faults_on_20_percent_of_requests_resend_only_the_failed_parts(s3_server, s3_url, storage_log):
    write_through_faults(s3_server, s3_url, storage_log)


@pytest.mark.parametrize("answers", [["reset_after"], ["reset_after", "no_such_upload"]])
def test_a_completion_whose_reply_is_lost_is_not_mistaken_for_a_failure(s3_server, s3_url, storage_log, answers):
    """The server completes the upload, the reply is lost; the retry finds it completed (SeaweedFS) or
    is told the upload is gone (S3) and finds the whole object there."""
    data, views = seven_part_file()
    with proxied_storage(s3_server, s3_url, _completions(answers)) as (storage, proxy, _):
        storage.write_file("shard.bin", views)
    assert proxy.faults == dict.fromkeys(answers, 1)
    assert storage.stats.snapshot() == {"retries": {"no reply": 1}, "failures": {}}
    assert any("completing the upload of" in line for line in retry_lines(storage_log))
    assert stored(s3_server, s3_url) == data


def test_a_completion_that_never_reached_the_server_is_not_taken_for_done(s3_server, s3_url):
    _, views = seven_part_file()
    with (proxied_storage(s3_server, s3_url, _completions(["reset", "no_such_upload"])) as (storage, _, _),
          pytest.raises(bcp.StorageError, match="NoSuchUpload")):
        storage.write_file("shard.bin", views)
    assert not S3Objects(s3_url, **s3_server.options()).exists("shard.bin")


def _completions(answers: list[str]):
    """A fault rule answering the successive CompleteMultipartUpload requests with ``answers``."""
    pending = iter(answers)
    return lambda method, path: next(pending, None) if method == "POST" and "uploadId=" in path else None


def test_a_permanent_403_on_a_part_fails_at_once_and_leaves_no_object(s3_server, s3_url, storage_log):
    _, views = seven_part_file()
    forbid = lambda method, path: "forbidden" if part_number(method, path) == 3 else None
    with (proxied_storage(s3_server, s3_url, forbid) as (storage, _, faults),
          pytest.raises(bcp.CheckpointError, match="403") as failure):
        storage.write_file("shard.bin", views)
    message = str(failure.value)
    assert isinstance(failure.value, bcp.StorageError)
    assert f"{s3_url}/shard.bin bytes {2 * PART}-{3 * PART - 1}" in message, message
    assert "attempt 1 (permanent error)" in message and "AccessDenied" in message
    assert len(faults.faulted) == 1 and not retry_lines(storage_log)
    assert storage.stats.snapshot() == {"retries": {}, "failures": {"AccessDenied": 1}}
    # aborted, not completed: no object, and no upload left pending under the name
    direct = S3Objects(s3_url, **s3_server.options())
    assert ("DELETE" in {method for method, _ in faults.seen}) and not direct.exists("shard.bin")
    key = f"{s3_url.split('/', 3)[3]}/shard.bin"
    pending = direct.connection.call("list_multipart_uploads", "listing uploads", Prefix=key)
    assert not pending.get("Uploads"), pending


def test_a_checkpoint_with_multipart_data_files_saves_and_loads_bitwise(s3_server, s3_url):
    model = torch.nn.Linear(2048, 1536)  # 12 MiB of weights: a data file of three 5 MiB parts
    fresh = torch.nn.Linear(2048, 1536)
    with proxied_storage(s3_server, s3_url, lambda method, path: None) as (storage, _, faults):
        bcp.save(storage, {"model": model})
        bcp.load(storage, {"model": fresh})
    parts = {part_number(method, path) for method, path in faults.seen} - {None}
    assert parts == {1, 2, 3}
    for name, value in model.state_dict().items():
        assert torch.equal(value.view(torch.int32), fresh.state_dict()[name].view(torch.int32)), name


def test_parts_smaller_than_s3_allows_are_refused():
    with pytest.raises(ValueError, match="part_bytes"):
        S3Objects("s3://ckpt/x", endpoint_url="http://127.0.0.1:1", part_bytes=PART - 1)
