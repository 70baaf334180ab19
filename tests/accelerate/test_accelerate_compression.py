"""``bcp_accelerate.enable(accelerator, compression="zstd")``: ``save_state`` writes a compressed
checkpoint (format version 4, fewer bytes stored than held), and an accelerator that does not
compress resumes from it with everything restored bitwise and the next steps equal to an
uninterrupted run's. A real accelerator on one CPU process."""

from __future__ import annotations

import bcp_accelerate
from accelerate_helpers import SAVED_AT, build, resume_matches_uninterrupted, session, snapshot, train
from compressed import assert_compressed


def test_a_compressed_checkpoint_resumes_bitwise(tmp_path):
    path = str(tmp_path / "ckpt")
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, compression="zstd")
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(SAVED_AT))
        accelerator.save_state(path)
        saved = snapshot(accelerator, model, optimizer, scheduler)
    assert_compressed(path)
    resume_matches_uninterrupted(path, [saved], fsdp2=False)
