"""``docs/benchmarks.md`` changes only through ``make bench-docs`` (``benchmarks/publish.py``), and
that command rewrites only the page's marked blocks: the hand-written measurements between them (S3,
planning over gRPC, dataloader state) survive it. A past defect this guards: the quick benchmark
rewrote the whole tracked page, deleting every table it does not measure."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bcpbench import compression  # noqa: E402
from bcpbench import distributed as d2  # noqa: E402
from bcpbench import every_step  # noqa: E402
from bcpbench import fsdp1  # noqa: E402
from bcpbench import incremental as inc  # noqa: E402
from bcpbench import single as d1  # noqa: E402
from bcpbench import tensor_path  # noqa: E402
from bcpbench.publish import PublishError, begin_marker, end_marker, marked_names  # noqa: E402
from bcpbench.record import Record  # noqa: E402
from bcpbench.report import blocks  # noqa: E402

import publish  # noqa: E402  (benchmarks/publish.py)

PAGE = os.path.join(ROOT, "docs", "benchmarks.md")


def a_run(profile: str = "full", cases: tuple[str, ...] | None = None) -> dict:
    """A small run of every path (or only ``cases``) with recognisable figures."""
    every = cases is None
    cases = cases or (d1.SAVE, d1.COLD, d1.ASYNC_BLOCK, fsdp1.BLOCKING, d2.RESHARDED, tensor_path.SAVE_1P)
    methods = {"bcp": [1.25], "DCP": [2.5], "raw write/read, 4 threads": [1.0]}
    samples = {case: dict(methods) for case in cases}
    run = {"profile": profile, "command": f"benchmarks/run.py --{profile}", "commit": "abc1234",
           "started": "2030-01-02 03:04", "minutes": 1.0, "reps": 5, "state_mb": 2131.0, "tensors": 100,
           "torch_threads_1p": 2, "io_threads": 4, "dcp_threads": 4, "versions": "torch x",
           "machine": {"cores": 64, "ram_gb": 512, "load_before": "0.1", "load_after": "0.2", "disk_free_gb": 900},
           "planning_scale": {"ranks": 8960, "coordinator_total_s": 7.77}}
    figures = {"bcp save phases, 1p": [{"collect": 0.1, "plan": 0.01, "write": 1.0, "commit": 0.02}]}
    if every:  # the incremental saves' path too
        samples.update({case: {inc.INCREMENTAL: [0.05], inc.TRAINABLE: [0.045]} for case in (inc.FIRST, inc.LATER)})
        samples[inc.LOAD] = {inc.INCREMENTAL: [1.0], inc.WHOLE: [1.0]}
        figures["fine-tuning state"] = {"parameters": 268 * 10**6, "trainable": 2_680_000, "rank": 14, "tensors": 166}
        figures.update({f"fine-tuning bytes written: {m}": [1.1e9] + [3.2e7] * 4 for m in (inc.INCREMENTAL, inc.TRAINABLE)})
        samples[every_step.STEP] = {every_step.NONE: [0.2], every_step.OVERLAP: [0.202]}
        samples[every_step.BLOCKING] = {every_step.OVERLAP: [0.002]}
        figures[every_step.MODEL] = {"width": 2048, "layers": 8, "batch": 128, "steps": 12, "rounds": 3,
                                     "state_bytes": 384 << 20, "ratios": {every_step.OVERLAP: 1.01}}
        figures[compression.TRAINING] = {"width": 2048, "layers": 8, "batch": 64, "steps": 200, "lr": 3e-4,
                                         "seconds": 90.0, "first_loss": 0.25, "last_loss": 0.01, "relative_change": 0.5,
                                         "ks_distance": 0.06, "bcp_compresses": True}
        for label in (compression.BF16, compression.MIXED):
            for what in ("save", "cold load"):
                where = compression.case(label, what, compression.LOCAL)
                samples[where] = {compression.BCP: [0.5], compression.BCP_COMPRESSED: [0.6]}
                figures.setdefault(compression.CPU, {})[where] = {compression.BCP: [0.4],
                                                                  compression.BCP_COMPRESSED: [0.9]}
            figures.setdefault(compression.STORED, {})[label] = {compression.BCP: 10**8,
                                                                 compression.BCP_COMPRESSED: 7 * 10**7}
    nbytes = {case: 2131 * 10**6 for case in (*cases, *(c for c in samples if c.startswith("compression")))}
    return {"run": run, "samples": samples, "nbytes": nbytes, "figures": figures}


def outside_blocks(text: str) -> str:
    """The page without its marked blocks' contents: what a publish must keep."""
    for name in marked_names(text):
        head, rest = text.split(begin_marker(name), 1)
        text = head + "<block>" + rest.split(end_marker(name), 1)[1]
    return text


def write(path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_the_page_has_a_block_for_every_path_the_report_renders():
    with open(PAGE) as f:
        names = marked_names(f.read())
    data = a_run()
    assert sorted(names) == sorted(blocks(Record(data), data["run"]))
    assert len(names) == len(set(names))


def test_publishing_a_full_run_rewrites_the_blocks_and_keeps_everything_else(tmp_path):
    page = tmp_path / "benchmarks.md"
    with open(PAGE) as f:
        before = f.read()
    page.write_text(before)
    publish.publish(write(tmp_path / "run.json", a_run()), str(page))
    after = page.read_text()
    assert outside_blocks(after) == outside_blocks(before)
    assert "abc1234" in after and "2030-01-02 03:04" in after and "| 7.77 |" in after
    assert "21.3 min" not in after  # the previous run's facts are gone
    publish.publish(str(tmp_path / "run.json"), str(page))
    assert page.read_text() == after  # publishing the same run again changes nothing


def test_a_quick_run_or_a_partial_run_is_refused_and_the_page_is_left_alone(tmp_path):
    page = tmp_path / "benchmarks.md"
    with open(PAGE) as f:
        page.write_text(f.read())
    before = page.read_text()
    with pytest.raises(PublishError, match="'quick' run"):
        publish.publish(write(tmp_path / "quick.json", a_run("quick")), str(page))
    with pytest.raises(PublishError, match="measured nothing for .*fsdp1"):
        publish.publish(write(tmp_path / "partial.json", a_run(cases=(d1.SAVE, d1.COLD, d1.ASYNC_BLOCK))), str(page))
    assert page.read_text() == before


def test_a_page_that_lost_a_marker_is_refused(tmp_path):
    page = tmp_path / "benchmarks.md"
    with open(PAGE) as f:
        page.write_text(f.read().replace(end_marker("load"), ""))
    with pytest.raises(PublishError, match="block load"):
        publish.publish(write(tmp_path / "run.json", a_run()), str(page))
