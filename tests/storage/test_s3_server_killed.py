"""The S3 server SIGKILLed in the middle of a save: the previous checkpoint still loads bitwise, the
half-written generation is never taken for a checkpoint, and after a restart the next save succeeds."""

from __future__ import annotations

import bcp
import pytest
import s3_test_server
from bcp.storage import RetryPolicy, S3Storage
from models import assert_bitwise, build, full_state, train
from s3_fault_proxy import FaultProxy


@pytest.fixture
def own_server(tmp_path):
    """A server of this test's own, since the test kills it."""
    servers = [s3_test_server.start(str(tmp_path))]
    yield servers
    s3_test_server.stop(servers[-1])


def _trained(seed: int, steps: int) -> tuple:
    model, optimizer = build("plain", seed=seed)
    train(model, optimizer, range(steps))
    return model, optimizer


def _loaded(storage: S3Storage) -> dict:
    model, optimizer = build("plain", seed=99)
    bcp.load(storage, {"model": model, "optimizer": optimizer})
    return full_state(model, optimizer)


def test_a_save_cut_by_a_killed_server_leaves_the_previous_checkpoint_loadable(own_server):
    server = own_server[0]

    def kill_before_the_second_manifest(method: str, path: str) -> str | None:
        # Every data file of generation 2 is written by now; only its manifest and marker are not.
        if method == "PUT" and "gen-00000002/manifest.json" in path and server.process.poll() is None:
            s3_test_server.stop(server)
        return None

    proxy = FaultProxy(server.endpoint, kill_before_the_second_manifest)
    try:
        storage = S3Storage("s3://ckpt/run", retry=RetryPolicy(max_attempts=3, first_delay_s=0.01),
                            **server.options(proxy.endpoint))
        first = _trained(seed=1, steps=1)
        bcp.save(storage, {"model": first[0], "optimizer": first[1]})
        second = _trained(seed=2, steps=2)
        with pytest.raises(bcp.StorageError, match="s3://ckpt/run"):
            bcp.save(storage, {"model": second[0], "optimizer": second[1]})
        assert server.process.poll() is not None  # the server really died mid-save

        own_server.append(s3_test_server.start(server.directory, ports=server.ports))
        assert "gen-00000002" in storage.list_dir("")  # the partial generation is there ...
        assert not storage.exists("gen-00000002/COMMITTED")
        assert_bitwise(full_state(*first), _loaded(storage))  # ... and never taken for the checkpoint

        third = _trained(seed=3, steps=3)
        bcp.save(storage, {"model": third[0], "optimizer": third[1]})
        assert_bitwise(full_state(*third), _loaded(storage))
    finally:
        proxy.close()
