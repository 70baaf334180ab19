"""Who may talk to a gRPC coordinator node: callers with the job's secret only (others are refused
and logged); nothing off loopback in the default setup; malformed and oversized calls are refused
and the node keeps serving; optional mutual TLS with the user's certificates."""

from __future__ import annotations

import logging
import random
import socket
import subprocess

import grpc
import pytest
import torch.distributed as dist
from grpc_nodes import close_all, on_threads, start_nodes

import bcp
from bcp.coord.grpc import TlsConfig, tree_pb2, tree_pb2_grpc
from bcp.coord.grpc.security import SECRET_HEADER

EXCHANGE = "/bcp.coord.Tree/Exchange"
LIMIT = 16 << 10  # the nodes' largest message: small, so that an oversized call is quick to send


def all_gather_works(nodes) -> bool:
    got = on_threads(len(nodes), lambda r: nodes[r].all_gather_bytes(bytes([r]) * 3))
    return all(g == [bytes([r]) * 3 for r in range(len(nodes))] for g in got)


def job_secret(store, namespace: str) -> str:
    return dist.PrefixStore(f"bcp/grpc/{namespace}", store).get("secret").decode()


def stranger_call(address: str, metadata=None) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            tree_pb2_grpc.TreeStub(channel).Exchange(tree_pb2.Up(exchange=0, op=tree_pb2.GATHER, sender=1),
                                                     timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def three_nodes():
    store = dist.HashStore()
    nodes = on_threads(3, lambda r: bcp.coord.grpc.GrpcCoordinator(store=store, rank=r, world_size=3, timeout=20,
                                                                   ranks_per_machine=3, namespace="strangers",
                                                                   max_message_bytes=LIMIT))
    yield nodes, store
    close_all(nodes)


def test_calls_without_the_job_secret_are_refused_and_logged(three_nodes, caplog):
    nodes, store = three_nodes
    address = nodes[0].address
    with caplog.at_level(logging.WARNING, logger="bcp.coord"):
        assert stranger_call(address) == grpc.StatusCode.UNAUTHENTICATED
        assert stranger_call(address, ((SECRET_HEADER, "guess"),)) == grpc.StatusCode.UNAUTHENTICATED
        # With the secret, the same (malformed) call passes the check and is refused for its content.
        secret = job_secret(store, "strangers")
        assert stranger_call(address, ((SECRET_HEADER, secret),)) == grpc.StatusCode.INVALID_ARGUMENT
    refusals = [r.getMessage() for r in caplog.records if r.name == "bcp.coord"]
    assert any("no job secret" in m for m in refusals) and any("a wrong job secret" in m for m in refusals)
    assert all_gather_works(nodes)


def non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))  # picks a route; sends nothing
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_a_node_listens_on_loopback_only_by_default(three_nodes):
    nodes, _ = three_nodes
    host, port = nodes[0].address.rsplit(":", 1)
    assert host == "127.0.0.1"
    other = non_loopback_address()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with socket.socket() as s, pytest.raises(OSError):
        s.settimeout(5)
        s.connect((other, int(port)))


def fuzz_payloads(rng: random.Random, inbox, count: int, oversized: int) -> list[bytes]:
    """Random bytes and random well-formed messages that do not fit the tree, then oversized ones."""
    payloads: list[bytes] = []
    while len(payloads) < count - oversized:
        if rng.randrange(2):
            data = rng.randbytes(rng.randrange(0, 2048))
        else:
            up = tree_pb2.Up(exchange=rng.randrange(1 << 40), op=rng.randrange(6), sender=rng.randrange(1 << 20),
                             parts=[tree_pb2.Part(rank=rng.randrange(8), data=rng.randbytes(rng.randrange(64)))
                                    for _ in range(rng.randrange(4))])
            data = up.SerializeToString()
        try:  # leave out what would be a genuine contribution of a child: that one is trusted
            if inbox.problem_with(tree_pb2.Up.FromString(data)) is None:
                continue
        except Exception:
            pass
        payloads.append(data)
    # Refusing an oversized call takes the connection a fraction of a second: a few suffice.
    return payloads + [rng.randbytes(LIMIT + rng.randrange(1, 4096)) for _ in range(oversized)]


def test_malformed_and_oversized_calls_are_refused_and_the_node_keeps_serving(three_nodes):
    nodes, store = three_nodes
    metadata = ((SECRET_HEADER, job_secret(store, "strangers")),)
    codes: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(nodes[0].address) as channel:
        call = channel.unary_unary(EXCHANGE)  # raw bytes: no serializer
        for payload in fuzz_payloads(random.Random(15), nodes[0]._inbox, 300, oversized=12):
            try:
                call(payload, timeout=5, metadata=metadata)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            codes[code] = codes.get(code, 0) + 1
    assert grpc.StatusCode.OK not in codes, codes
    assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL,
                          grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) > 0  # the oversized ones
    assert all_gather_works(nodes)


def make_certificates(folder) -> TlsConfig:
    """A throwaway authority and one certificate for 127.0.0.1 signed by it (openssl)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=bcp test authority")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=bcp node")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "node.pem", "-days", "1", "-extfile", "san.ext")
    return TlsConfig(certificate_chain=(folder / "node.pem").read_bytes(),
                     private_key=(folder / "node.key").read_bytes(),
                     root_certificates=(folder / "ca.pem").read_bytes())


def test_nodes_talk_over_mutual_tls_and_plaintext_callers_get_nothing(tmp_path):
    tls = make_certificates(tmp_path)
    nodes = start_nodes(3, "tls", timeout=20, ranks_per_machine=3, tls=tls)
    try:
        assert all_gather_works(nodes)
        assert stranger_call(nodes[0].address) == grpc.StatusCode.UNAVAILABLE
    finally:
        close_all(nodes)
