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
    NONE = "no checkpoint (neither a bcp checkpoint nor the Trainer's own files)"


def contents(folder: str) -> Contents:
    location = checkpoint_location(folder, None)
    if location.newest_committed() is not None:
        return Contents.BCP
    names = set(_names(folder))
    trainer_files = names & set(_TRAINER_FILES)
    if location.generations():
        return Contents.INCOMPLETE
    if trainer_files:
        return Contents.TRANSFORMERS if TRAINER_STATE_NAME in names else Contents.INCOMPLETE
    return Contents.NONE


_WHOLE = (Contents.BCP, Contents.TRANSFORMERS)


def newest_resumable(output_dir: str) -> str:
    """The highest-numbered ``checkpoint-<step>`` folder of ``output_dir`` holding a whole checkpoint."""
    found = [(int(m.group(1)), name) for name in _names(output_dir) if (m := _NUMBERED.match(name))]
    for _, name in sorted(found, reverse=True):
        folder = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)) and contents(folder) in _WHOLE:
            return folder
    # The Trainer's own wording first, which scripts and tests match.
    raise CheckpointNotFoundError(f"No valid checkpoint found in output directory: resume_from_checkpoint=True "
                                  f"found no {PREFIX_CHECKPOINT_DIR}-<step> folder holding a whole checkpoint",
                                  path=output_dir)


def _names(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []
