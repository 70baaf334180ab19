"""``bcp_transformers.enable(trainer, compression="zstd")``: each ``checkpoint-<step>`` is
compressed (format version 4, fewer bytes stored than held) and a Trainer that does not compress
resumes from it with the weights, AdamW state, scheduler and step restored bitwise. A real
Trainer on one CPU process."""

from __future__ import annotations

from compressed import assert_compressed
from trainer_helpers import SAVED_AT, assert_same_state, fit


def test_a_compressed_checkpoint_resumes_bitwise(tmp_path):
    first = fit(str(tmp_path / "first"), None, None, {"max_steps": SAVED_AT}, {"compression": "zstd"})
    checkpoint = str(tmp_path / "first" / f"checkpoint-{SAVED_AT}")
    assert_compressed(checkpoint)
    resumed = fit(str(tmp_path / "resumed"), None, checkpoint, {"max_steps": SAVED_AT + 1}, {})
    assert_same_state(resumed["at_start"], first["at_save"][SAVED_AT])
