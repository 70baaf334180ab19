"""``benchmarks/planning_scale.py`` runs in ``make bench`` after every group, outside any test of the
engine: a small world here keeps it in step with the records it builds and reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_small_world_is_planned_and_its_figures_written(tmp_path):
    out = tmp_path / "planning.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "planning_scale.py"), "--tp", "2",
                           "--pp", "2", "--dp", "2", "--manifest-shards", "1000", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["ranks"] == 8
    assert figures["local_pieces"] > 0 and figures["stored_shards"] > 0
    assert figures["parse_shards"] == 1000
