"""What a ``checkpoint-<step>`` folder holds, and which one ``resume_from_checkpoint=True`` resumes.

The Trainer's ``get_last_checkpoint`` takes the highest-numbered folder, whatever it holds. Under
bcp the newest folder may be a save still in flight (asynchronous) or one a crash interrupted, so
the resume takes the newest folder that holds a whole checkpoint: a committed bcp generation, or
the files of the Trainer's own engine.
"""

from __future__ import annotations

import enum
import os
import re

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from bcp import CheckpointNotFoundError
from bcp.integration import checkpoint_location

#: The Trainer's record of its progress, read by ``Trainer.train`` itself on resume.
TRAINER_STATE_NAME = "trainer_state.json"
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# The files the Trainer's own engine writes last-but-one (model) or with the optimizer.
_TRAINER_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                  "pytorch_model.bin.index.json", "optimizer.pt", "adapter_model.safetensors")


class Contents(enum.Enum):
    BCP = "a committed bcp checkpoint"
    TRANSFORMERS = "a checkpoint of the Trainer's own engine"
    INCOMPLETE = "no whole checkpoint (a save in flight or interrupted)"


def contents(folder: str) -> Contents:
    location = checkpoint_location(folder, None)
    if location.newest_committed() is not None:
        return Contents.BCP
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    if not location.generations() and TRAINER_STATE_NAME in names and names & set(_TRAINER_FILES):
        return Contents.TRANSFORMERS
    return Contents.INCOMPLETE


def newest_resumable(output_dir: str) -> str:
    """The highest-numbered ``checkpoint-<step>`` folder of ``output_dir`` holding a whole checkpoint."""
    found = [(int(m.group(1)), name) for name in _names(output_dir) if (m := _NUMBERED.match(name))]
    for _, name in sorted(found, reverse=True):
        folder = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)) and contents(folder) is not Contents.INCOMPLETE:
            return folder
    raise CheckpointNotFoundError(f"resume_from_checkpoint=True: no {PREFIX_CHECKPOINT_DIR}-<step> folder holds a "
                                  "whole checkpoint", path=output_dir)


def _names(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []
