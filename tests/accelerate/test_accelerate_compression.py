"""``bcp_accelerate.enable(accelerator, compression="zstd")``: ``save_state`` writes a compressed
checkpoint (format version 4, fewer bytes stored than held), and an accelerator that does not
compress resumes from it with everything restored bitwise and the next steps equal to an
uninterrupted run's. A real accelerator on one CPU process."""

from __future__ import annotations

import bcp_accelerate
import torch
from accelerate_helpers import SAVED_AT, build, resume_matches_uninterrupted, session, snapshot, train
from compressed import assert_compressed


class Mask:
    """An object registered for checkpointing whose state is a tensor that compresses (a mask of
    zeros): the shared MLP's tensors hold a few hundred values each, too few for any codec to shrink."""

    def __init__(self, fill: float) -> None:
        self.mask = torch.full((4096,), fill)

    def state_dict(self) -> dict:
        return {"mask": self.mask}

    def load_state_dict(self, state: dict) -> None:
        self.mask.copy_(state["mask"])


def test_a_compressed_checkpoint_resumes_bitwise(tmp_path):
    path = str(tmp_path / "ckpt")
    with session() as accelerator:
        bcp_accelerate.enable(accelerator, compression="zstd")
        accelerator.register_for_checkpointing(Mask(0.0))
        model, optimizer, scheduler = build(accelerator, seed=1)
        train(accelerator, model, optimizer, scheduler, range(SAVED_AT))
        accelerator.save_state(path)
        saved = snapshot(accelerator, model, optimizer, scheduler)
    assert_compressed(path)
    resumed = Mask(1.0)
    resume_matches_uninterrupted(path, [saved], fsdp2=False, registered=[resumed])
    assert torch.equal(resumed.mask, torch.zeros(4096))
