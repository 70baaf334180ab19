"""Where the S3 backend finds its credentials, against the real SeaweedFS server, with no AWS_* keys
in the environment: a profile in the shared config and credentials files; temporary credentials with
a session token issued by the server's STS (AssumeRole), which checks the token on every request;
a profile's ``credential_process`` (a program that prints them); a container credentials endpoint; a web identity token exchanged at the server's STS
(AssumeRoleWithWebIdentity, the token signed by an OIDC issuer the test runs); instance metadata
(an IMDSv2 endpoint the test runs). Large files go part by part, each part retried on its own,
through the fault proxy, and checkpoints load back."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import bcp
import pytest
import s3_test_server as seaweedfs
import torch
from bcp.storage import S3Storage
from s3_part_uploads import PART, seven_part_file, write_through_faults

PROFILE = "bcp-writer"


@pytest.fixture
def no_aws_variables(monkeypatch):
    """An environment without any AWS_* variable (and without instance metadata lookups, which would
    wait for a link-local address that does not answer here)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _use_profile(directory, monkeypatch, keys: dict[str, str], endpoint: str | None = None) -> None:
    """A shared credentials file holding ``keys`` under the profile, a config file giving it a region
    (and ``endpoint``), and AWS_PROFILE naming it."""
    credentials = directory / "credentials"
    lines = [f"[{PROFILE}]", f"aws_access_key_id = {keys['access_key_id']}",
             f"aws_secret_access_key = {keys['secret_access_key']}"]
    if keys.get("session_token"):
        lines.append(f"aws_session_token = {keys['session_token']}")
    credentials.write_text("\n".join(lines) + "\n")
    config = directory / "config"
    config.write_text(f"[profile {PROFILE}]\nregion = us-east-1\n" + (f"endpoint_url = {endpoint}\n" if endpoint else ""))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", PROFILE)


def _static_keys(s3_server) -> dict[str, str]:
    options = s3_server.options()
    return {"access_key_id": options["access_key_id"], "secret_access_key": options["secret_access_key"]}


def test_a_profile_in_the_shared_files_alone_uploads_a_large_file_part_by_part_through_faults(
        s3_server, s3_url, storage_log, tmp_path, monkeypatch, no_aws_variables):
    _use_profile(tmp_path, monkeypatch, _static_keys(s3_server))
    storage, _ = write_through_faults(s3_server, s3_url, storage_log, credentials={})
    assert storage.inner.connection.credentials().method == "shared-credentials-file"


def test_a_session_token_from_the_profile_signs_every_request_and_the_server_checks_it(
        s3_server, s3_url, storage_log, tmp_path, monkeypatch, no_aws_variables):
    temporary = s3_server.assume_role()
    _use_profile(tmp_path, monkeypatch, temporary)
    write_through_faults(s3_server, s3_url, storage_log, credentials={})  # parts: botocore's client
    data, _ = seven_part_file()
    assert S3Storage(s3_url, endpoint_url=s3_server.endpoint).read_bytes("shard.bin") == data  # obstore's

    # the server does check it: the same temporary key without its token is refused at once
    (tmp_path / "tokenless").mkdir()
    _use_profile(tmp_path / "tokenless", monkeypatch, {**temporary, "session_token": ""})
    with pytest.raises(bcp.StorageError, match="InvalidAccessKeyId") as refused:
        S3Storage(s3_url, endpoint_url=s3_server.endpoint).read_bytes("shard.bin")
    assert "attempt 1 (permanent error)" in str(refused.value)


def test_a_plain_url_saves_and_loads_with_endpoint_and_keys_from_the_profile(
        s3_server, s3_url, tmp_path, monkeypatch, no_aws_variables):
    _use_profile(tmp_path, monkeypatch, _static_keys(s3_server), endpoint=s3_server.endpoint)
    model, fresh = torch.nn.Linear(2048, 1536), torch.nn.Linear(2048, 1536)
    bcp.save(s3_url, {"model": model})
    bcp.load(s3_url, {"model": fresh})
    for name, value in model.state_dict().items():
        assert torch.equal(value.view(torch.int32), fresh.state_dict()[name].view(torch.int32)), name


def test_a_credential_process_alone_signs_a_large_file_part_by_part_through_faults_and_a_load(
        s3_server, s3_url, storage_log, tmp_path, monkeypatch, no_aws_variables):
    """A profile whose credentials come from a program (``credential_process``, as SSO helpers and
    vaults provide them): botocore runs it and both clients sign with what it prints, a session token
    included, which the server checks on every request."""
    temporary = s3_server.assume_role()
    ran = tmp_path / "ran"
    program = tmp_path / "credentials.py"
    program.write_text(
        "import json, pathlib\n"
        f"pathlib.Path({str(ran)!r}).open('a').write('ran\\n')\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {temporary['access_key_id']!r}, "
        f"'SecretAccessKey': {temporary['secret_access_key']!r}, 'SessionToken': {temporary['session_token']!r}, "
        "'Expiration': '2099-01-01T00:00:00Z'}))\n")
    config = tmp_path / "config"
    config.write_text(f"[profile {PROFILE}]\nregion = us-east-1\n"
                      f"credential_process = {sys.executable} {program}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", PROFILE)

    storage, _ = write_through_faults(s3_server, s3_url, storage_log, credentials={})  # parts: botocore's client
    assert storage.inner.connection.credentials().method == "custom-process"
    data, _ = seven_part_file()
    assert S3Storage(s3_url, endpoint_url=s3_server.endpoint).read_bytes("shard.bin") == data  # obstore's
    _save_and_load_bitwise(f"{s3_url}/run", endpoint_url=s3_server.endpoint)
    assert ran.read_text().count("ran") >= 1

    # the server does check the token the program prints: the same key without it is refused
    program.write_text(program.read_text().replace(temporary["session_token"], ""))
    monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "bcp-tokenless")  # a new store connection: the program run anew
    with pytest.raises(bcp.StorageError, match="InvalidAccessKeyId") as refused:
        S3Storage(s3_url, endpoint_url=s3_server.endpoint).read_bytes("shard.bin")
    assert "attempt 1 (permanent error)" in str(refused.value)


def test_temporary_credentials_from_a_container_endpoint(s3_server, s3_url, monkeypatch, no_aws_variables):
    temporary = s3_server.assume_role()
    answer = json.dumps({"AccessKeyId": temporary["access_key_id"], "SecretAccessKey": temporary["secret_access_key"],
                         "Token": temporary["session_token"], "Expiration": "2099-01-01T00:00:00Z"}).encode()
    asked = []

    class Credentials(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    endpoint = ThreadingHTTPServer(("127.0.0.1", 0), Credentials)
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI",
                           f"http://127.0.0.1:{endpoint.server_address[1]}/v2/credentials/bcp")
        storage = S3Storage(s3_url, endpoint_url=s3_server.endpoint, region="us-east-1", part_bytes=PART)
        data, views = seven_part_file()
        storage.write_file("shard.bin", views)
        assert storage.read_bytes("shard.bin") == data
    finally:
        endpoint.shutdown()
        endpoint.server_close()
    assert asked == ["/v2/credentials/bcp"]
    assert storage.inner.connection.credentials().method == "container-role"


def test_without_any_credentials_the_first_request_fails_at_once_saying_where_it_looked(
        s3_url, tmp_path, monkeypatch, no_aws_variables, storage_log):
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(bcp.StorageError, match="no AWS credentials found") as failure:
        S3Storage(s3_url, endpoint_url="http://127.0.0.1:1").exists("x")
    assert "attempt 1 (permanent error)" in str(failure.value) and "AWS_PROFILE" in str(failure.value)
    assert not [r for r in storage_log.records if "retrying" in r.getMessage()]


def test_an_unknown_profile_is_a_storage_error_naming_the_url_and_the_profile(s3_url, monkeypatch, no_aws_variables):
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(bcp.StorageError, match="no-such-profile") as failure:
        S3Storage(s3_url)
    assert s3_url in str(failure.value)


@pytest.mark.parametrize(("options", "bucket_url"), [
    ({"region": "us-west-2"}, "https://my-bucket.s3.us-west-2.amazonaws.com/"),  # AWS: virtual-hosted
    ({"endpoint_url": "http://minio:9000"}, "http://minio:9000/my-bucket/"),  # elsewhere: path-style
    ({"endpoint_url": "http://minio:9000", "addressing_style": "virtual"}, "http://my-bucket.minio:9000/"),
])
def test_both_clients_address_the_bucket_alike(options, bucket_url, no_aws_variables):
    """botocore (parts) and obstore (everything else) must send to the same URLs: botocore's, read
    from a URL it signs (no request is made), and obstore's endpoint setting."""
    connection = S3Storage("s3://my-bucket/x", access_key_id="a", secret_access_key="b", **options).inner.connection
    signed = connection.client.generate_presigned_url("get_object", Params={"Bucket": "my-bucket", "Key": "k"})
    assert signed.startswith(f"{bucket_url}k?")
    config = connection.store.config
    obstore_url = (f"{config['endpoint']}/" if config["virtual_hosted_style_request"] == "true"
                   else f"{config['endpoint']}/my-bucket/")
    assert obstore_url == bucket_url


def _save_and_load_bitwise(url: str, **options: object) -> None:
    """A checkpoint whose data file is several 5 MiB parts, saved and loaded back into a fresh model."""
    model, fresh = torch.nn.Linear(2048, 1536), torch.nn.Linear(2048, 1536)
    bcp.save(S3Storage(url, part_bytes=PART, **options), {"model": model})
    bcp.load(S3Storage(url, **options), {"model": fresh})
    for name, value in model.state_dict().items():
        assert torch.equal(value.view(torch.int32), fresh.state_dict()[name].view(torch.int32)), name


def test_a_web_identity_token_and_role_alone_upload_part_by_part_through_faults_and_load(
        s3_server, s3_url, storage_log, oidc_issuer, tmp_path, monkeypatch, no_aws_variables):
    """As on EKS (IRSA): a token file and a role ARN; botocore exchanges the token for temporary
    credentials with the server's STS (AssumeRoleWithWebIdentity), which checks the token's signature
    against the keys the test's OIDC issuer serves. A token it refuses fails at once, naming the
    source (it was retried ten times as if the server had not answered)."""
    token = tmp_path / "token"
    token.write_text(oidc_issuer.token())
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ROLE_ARN", seaweedfs.FEDERATED_ROLE_ARN)
    monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "bcp-trainer")
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", s3_server.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    storage, _ = write_through_faults(s3_server, s3_url, storage_log, credentials={})
    assert storage.inner.connection.credentials().method == "assume-role-with-web-identity"
    _save_and_load_bitwise(f"{s3_url}/run", endpoint_url=s3_server.endpoint)

    # the server does check the token: one signed by another issuer's key gets no credentials
    from s3_oidc import OidcIssuer

    stranger = OidcIssuer()
    try:
        token.write_text(stranger.token())
    finally:
        stranger.close()
    monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "bcp-stranger")  # a new store connection: the token read anew
    refusal = r"credentials \(assume-role-with-web-identity\).*AccessDenied"
    with pytest.raises(bcp.StorageError, match=refusal) as refused:
        S3Storage(f"{s3_url}/other", endpoint_url=s3_server.endpoint).exists("x")
    assert "attempt 1 (permanent error)" in str(refused.value)


class InstanceMetadata(BaseHTTPRequestHandler):
    """An IMDSv2 endpoint as an EC2 instance has at 169.254.169.254, which cannot exist here, so the
    test runs one (``AWS_EC2_METADATA_SERVICE_ENDPOINT`` points botocore at it): a session token from
    ``PUT /latest/api/token``, then the instance role's name and its temporary credentials, answered
    only to requests carrying that token."""

    ROLE = "ckpt-instance"
    SESSION = "imds-session-token"
    credentials: bytes = b""
    asked: list[str] = []

    def do_PUT(self) -> None:
        self.asked.append(f"PUT {self.path}")
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._answer(200, self.SESSION.encode())
        self._answer(400, b"")

    def do_GET(self) -> None:
        self.asked.append(f"GET {self.path}")
        if self.headers.get("X-aws-ec2-metadata-token") != self.SESSION:
            return self._answer(401, b"")
        prefix = "/latest/meta-data/iam/security-credentials/"
        answers = {prefix: self.ROLE.encode(), prefix + self.ROLE: self.credentials}
        self._answer(200, answers[self.path]) if self.path in answers else self._answer(404, b"")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_instance_metadata_credentials_upload_part_by_part_through_faults_and_load(
        s3_server, s3_url, storage_log, monkeypatch, no_aws_variables):
    temporary = s3_server.assume_role()
    InstanceMetadata.credentials = json.dumps({
        "Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": temporary["access_key_id"],
        "SecretAccessKey": temporary["secret_access_key"], "Token": temporary["session_token"],
        "Expiration": "2099-01-01T00:00:00Z", "LastUpdated": "2026-01-01T00:00:00Z"}).encode()
    InstanceMetadata.asked = []
    endpoint = ThreadingHTTPServer(("127.0.0.1", 0), InstanceMetadata)
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{endpoint.server_address[1]}/")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        storage, _ = write_through_faults(s3_server, s3_url, storage_log, credentials={})
        assert storage.inner.connection.credentials().method == "iam-role"
        _save_and_load_bitwise(f"{s3_url}/run", endpoint_url=s3_server.endpoint)
    finally:
        endpoint.shutdown()
        endpoint.server_close()
    role = f"/latest/meta-data/iam/security-credentials/{InstanceMetadata.ROLE}"
    assert InstanceMetadata.asked[0] == "PUT /latest/api/token" and f"GET {role}" in InstanceMetadata.asked
