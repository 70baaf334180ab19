"""How a trainer checkpoints through bcp: the options of ``bcp_transformers.enable``."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Trainer

from bcp import Compression

_OPTIONS = "_bcp_checkpoint_options"


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
    """The defaults are what ``TRANSFORMERS_CHECKPOINT_ENGINE=bcp`` gives every trainer."""

    #: The training loop continues once the state is copied to host memory; the save commits in the
    #: background, and the next save, or the end of ``train``, waits for it.
    async_save: bool = False
    #: With ``async_save``: the save returns before the parameters and optimizer state are copied to
    #: host memory; the copy overlaps the next step's forward and backward, and the optimizer waits
    #: for it before it steps (``bcp.SaveOptions.overlap``).
    overlap: bool = False
    #: ``"zstd"`` (or ``True``): the tensors' bytes compressed losslessly on the writer threads
    #: (``bcp.SaveOptions.compression``); resumes read either kind.
    compression: "Compression | str | bool | None" = None
    #: Also write the Trainer's own model files (``config.json``, ``model.safetensors``) into each
    #: folder, for ``from_pretrained`` without ``bcp export``: a second, synchronous write of the model.
    save_model_files: bool = False


def set_options(trainer: Trainer, options: CheckpointOptions) -> None:
    setattr(trainer, _OPTIONS, options)


def options_of(trainer: Trainer) -> CheckpointOptions:
    return getattr(trainer, _OPTIONS, None) or CheckpointOptions()
