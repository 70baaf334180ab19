"""bcp.save / bcp.load on s3:// URLs against a real SeaweedFS server: resharding across world sizes,
async save, faults injected by a loopback proxy, a permanent 403, and bytes downloaded."""

from __future__ import annotations

import os
import random

import bcp
import pytest
import torch
from bcp.storage import RetryPolicy, S3Storage
from models import assert_bitwise, build, full_state, rank, train
from s3_fault_proxy import FaultProxy
from s3_sharded import COLS, load_big_sharded, save_big_sharded

ROWS = 4096  # 32 MiB of float32: large against the 1 MiB checksum chunks a read widens to


def _use(env: dict[str, str]) -> None:
    os.environ.update(env)  # the rank processes were started before the server: point them at it


def save_trained(kind: str, url: str, env: dict[str, str]) -> dict | None:
    _use(env)
    model, optimizer = build(kind, seed=1)
    train(model, optimizer, range(3))
    bcp.save(url, {"model": model, "optimizer": optimizer})
    state = full_state(model, optimizer)
    return state if rank() == 0 else None


def load_fresh(kind: str, url: str, env: dict[str, str], read_once: bool = False) -> dict | None:
    _use(env)
    model, optimizer = build(kind, seed=2)
    bcp.load(url, {"model": model, "optimizer": optimizer}, read_once=read_once)
    state = full_state(model, optimizer)
    return state if rank() == 0 else None


def test_a_two_rank_save_to_s3_loads_resharded_on_one_and_three_ranks_bitwise(ranks, s3_url, s3_env):
    url = f"{s3_url}/run"
    saved = ranks(2).run(save_trained, "fsdp2", url, s3_env)[0]
    assert_bitwise(saved, ranks(3).run(load_fresh, "fsdp2", url, s3_env)[0])
    assert_bitwise(saved, ranks(3).run(load_fresh, "ddp", url, s3_env, True)[0])  # read-once replicas
    assert_bitwise(saved, load_fresh("plain", url, s3_env))


def test_an_async_save_to_s3_commits_and_loads_bitwise(s3_url, s3_env):
    model, optimizer = build("plain", seed=1)
    train(model, optimizer, range(2))
    handle = bcp.save(s3_url, {"model": model, "optimizer": optimizer}, async_save=True)
    expected = full_state(model, optimizer)
    handle.wait()
    assert_bitwise(expected, load_fresh("plain", s3_url, s3_env))


def test_save_and_load_succeed_through_20_percent_faults_and_every_retry_is_logged_and_counted(
        s3_server, s3_url, storage_log):
    rng = random.Random(1)
    faults = ["slowdown", "reset", "reset_after"]
    proxy = FaultProxy(s3_server.endpoint, lambda method, path: rng.choice(faults) if rng.random() < 0.2 else None)
    try:
        storage = S3Storage(s3_url, retry=RetryPolicy(first_delay_s=0.01), **s3_server.options(proxy.endpoint))
        model, optimizer = build("plain", seed=1)
        train(model, optimizer, range(2))
        records = [bcp.save(storage, {"model": model, "optimizer": optimizer}).metrics
                   for _ in range(3)]  # several generations: commits, listings and retention all meet faults
        fresh, fresh_optimizer = build("plain", seed=2)
        records.append(bcp.load(storage, {"model": fresh, "optimizer": fresh_optimizer}).metrics)
    finally:
        proxy.close()
    assert_bitwise(full_state(model, optimizer), full_state(fresh, fresh_optimizer))
    retries = storage.stats.snapshot()["retries"]
    logged = [r for r in storage_log.records if r.name == "bcp.storage" and "retrying" in r.getMessage()]
    assert sum(proxy.faults.values()) > 0 and sum(retries.values()) == len(logged) > 0
    # each operation's metrics record carries the retries made during it: together, all of them
    assert sum(sum(record.ranks[0].retries.values()) for record in records) == sum(retries.values())
    assert storage.stats.snapshot()["failures"] == {}


def test_a_stalled_request_times_out_and_is_retried(s3_server, s3_url, storage_log):
    stalled = iter(range(1))  # the first data upload stalls; everything else goes through

    def stall_once(method: str, path: str) -> str | None:
        return "stall" if method == "PUT" and "/data/" in path and next(stalled, None) is not None else None

    proxy = FaultProxy(s3_server.endpoint, stall_once, stall_s=4.0)
    try:
        storage = S3Storage(s3_url, timeout_s=1.5, retry=RetryPolicy(first_delay_s=0.01),
                            **s3_server.options(proxy.endpoint))
        model, optimizer = build("plain", seed=1)
        train(model, optimizer, range(1))
        bcp.save(storage, {"model": model, "optimizer": optimizer})
        assert_bitwise(full_state(model, optimizer), _loaded_from(storage))
    finally:
        proxy.close()
    # at least: on a loaded machine an ordinary request may also outlast the short timeout
    assert proxy.faults["stall"] == 1 and storage.stats.snapshot()["retries"].get("no reply", 0) >= 1
    assert any("/data/" in r.getMessage() and "attempt 1 failed" in r.getMessage() for r in storage_log.records)


def _loaded_from(storage: S3Storage) -> dict:
    model, optimizer = build("plain", seed=2)
    bcp.load(storage, {"model": model, "optimizer": optimizer})
    return full_state(model, optimizer)


def test_loading_an_s3_url_that_holds_nothing_names_it(s3_url, s3_env):
    model, optimizer = build("plain", seed=1)
    with pytest.raises(bcp.CheckpointNotFoundError, match=s3_url):
        bcp.load(s3_url, {"model": model, "optimizer": optimizer})


def test_a_permanent_403_fails_at_once_with_a_checkpoint_error_naming_the_url(s3_url, s3_env, monkeypatch,
                                                                              storage_log):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    model, optimizer = build("plain", seed=1)
    with pytest.raises(bcp.CheckpointError, match="403") as failure:
        bcp.save(s3_url, {"model": model, "optimizer": optimizer})
    assert s3_url in str(failure.value) and "attempt 1 (permanent error)" in str(failure.value)
    assert not [r for r in storage_log.records if "retrying" in r.getMessage()]


def test_a_resharded_load_downloads_little_more_than_the_bytes_it_needs(ranks, s3_server, s3_url):
    url = f"{s3_url}/big"
    ranks(2).run(save_big_sharded, url, s3_server.env(), ROWS)
    proxy = FaultProxy(s3_server.endpoint)
    try:
        assert all(ranks(3).run(load_big_sharded, url, s3_server.env(proxy.endpoint), ROWS))
    finally:
        proxy.close()
    needed = ROWS * COLS * 4  # the three ranks' shards together are the whole matrix, once
    assert needed < proxy.get_body_bytes <= 1.2 * needed, (proxy.get_body_bytes, needed)


def test_the_inspect_and_verify_commands_take_s3_urls(s3_url, s3_env, capsys):
    from bcp.cli import main

    model, optimizer = build("plain", seed=1)
    bcp.save(s3_url, {"model": model, "optimizer": optimizer})
    assert main(["inspect", s3_url]) == 0
    assert main(["verify", s3_url]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint   {s3_url}" in out and "model/fc1.weight" in out and f"OK: {s3_url}" in out

