"""The two switches: ``bcp_transformers.enable(trainer)`` with its options (an asynchronous save
resumes like a synchronous one), and ``TRANSFORMERS_CHECKPOINT_ENGINE=bcp`` with no import of
bcp_transformers in the program (the installed ``.pth`` autoload)."""

from __future__ import annotations

import os
import subprocess
import sys

from trainer_helpers import SAVED_AT, assert_same_state, fit


def test_enable_with_async_saves_resumes_the_committed_state(ranks, tmp_path):
    first = ranks(2).run(fit, str(tmp_path / "first"), None, None, None, {"async_save": True})
    checkpoint = str(tmp_path / "first" / f"checkpoint-{SAVED_AT}")
    resumed = ranks(2).run(fit, str(tmp_path / "resumed"), None, checkpoint, None, {"async_save": True})
    assert_same_state(resumed[0]["at_start"], first[0]["at_save"][SAVED_AT])
    assert_same_state(resumed[1]["end"], first[1]["end"])


def test_the_environment_variable_alone_routes_the_trainer_once_it_is_imported():
    program = ("import sys; import transformers; assert 'bcp_transformers' not in sys.modules; "
               "from transformers import Trainer; print(getattr(Trainer._save_checkpoint, '_bcp_dispatches', False))")
    for value, expected in (("bcp", "True"), ("", "False")):
        env = {**os.environ, "TRANSFORMERS_CHECKPOINT_ENGINE": value}
        out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected
