"""Options objects and the per-process runtime: one frozen object per direction that the plain
keywords merge into, and one runtime object that tests (and jobs) can reset."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import bcp
from bcp.integration import reset_runtime, runtime


def test_keywords_and_options_objects_are_the_same_call(tmp_path):
    state = {"model": {"w": torch.arange(6.0)}}
    bcp.save(tmp_path / "a", state, bcp.SaveOptions(role="r1"))
    bcp.save(tmp_path / "b", state, role="r1")
    for path in ("a", "b"):
        live = {"model": {"w": torch.zeros(6)}}
        result = bcp.load(tmp_path / path, live, bcp.LoadOptions(role="r1"), verify=True)
        assert result.path.endswith("/r1") and torch.equal(live["model"]["w"], state["model"]["w"])


def test_keywords_override_the_options_object_and_unknown_ones_are_refused(tmp_path):
    options = bcp.LoadOptions(strict=False, io_threads=2)
    merged = options.merged({"strict": True})
    assert merged.strict and merged.io_threads == 2 and not options.strict
    with pytest.raises(TypeError, match="'verfiy'.*the options are"):
        bcp.load(tmp_path, {}, verfiy=False)
    with pytest.raises(TypeError):
        bcp.SaveOptions(True)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strict = True


def test_reset_runtime_waits_for_pending_saves_and_starts_afresh(tmp_path):
    before = runtime()
    handle = bcp.save(tmp_path, {"model": {"w": torch.ones(3)}}, async_save=True)
    reset_runtime()
    assert handle.done() and runtime() is not before
    handle.wait()
    live = {"model": {"w": torch.zeros(3)}}
    bcp.load(tmp_path, live)
    assert torch.equal(live["model"]["w"], torch.ones(3))
