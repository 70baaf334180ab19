"""Incremental saves to an object store (a real SeaweedFS): the later generations' manifests name
the first generation's objects, every kept generation loads bitwise on one rank and on three,
verifies, and retention keeps the objects a kept generation refers to."""

from __future__ import annotations

import bcp
from bcp.storage import storage_for
from lora_models import assert_round_trip, build_lora, save_fine_tuning
from models import train


def test_a_frozen_base_saved_three_times_to_s3_on_two_ranks_loads_bitwise_on_one_and_three(ranks, s3_url, s3_env):
    url = f"{s3_url}/incremental"
    saves = ranks(2).run(save_fine_tuning, "fsdp2", url, False, s3_env)
    assert_round_trip(ranks, url, saves, s3_env)
    assert bcp.tools.verify_checkpoint(url).ok


def test_retention_on_s3_keeps_the_objects_a_kept_generation_refers_to(s3_url, s3_env):
    url = f"{s3_url}/kept"
    model, optimizer = build_lora("plain", seed=1)
    for save in range(3):
        train(model, optimizer, range(save, save + 1))
        # each save's base is the generation committed when it starts: the previous one, once waited for
        bcp.save(url, {"model": model, "optimizer": optimizer}, incremental=True, keep_generations=1,
                 async_save=True).wait()
    assert sorted(n for n in storage_for(url).list_dir("") if n.startswith("gen-")) == ["gen-00000001", "gen-00000003"]
    report = bcp.tools.verify_checkpoint(url)
    assert report.ok and report.generation == 3
