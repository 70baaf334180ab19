"""bcp for Hugging Face Transformers: the ``Trainer``'s checkpoints through bcp.

``checkpoint-<step>`` folders keep the Trainer's conventions (``trainer_state.json``,
``get_last_checkpoint``, ``save_total_limit``, ``load_best_model_at_end``), and
``trainer.train(resume_from_checkpoint=True | path)`` resumes model, optimizer, scheduler, gradient
scaler, every process's RNG and the position in the data on any number of processes. Two ways to
switch it on:

- ``TRANSFORMERS_CHECKPOINT_ENGINE=bcp`` in the environment (every trainer, no code change: the
  installed ``bcp_transformers_autoload.pth`` imports this package once the Trainer is imported);
- ``bcp_transformers.enable(trainer)``, whose keywords set :class:`CheckpointOptions`.

Importing this package makes ``transformers.Trainer``'s checkpoint methods consult the switch on
each call; while it is off they are the Trainer's own, unchanged.
"""

from bcp_transformers.engine import finish_pending
from bcp_transformers.options import CheckpointOptions
from bcp_transformers.switch import ENGINE_VARIABLE, enable, install, requested_engine, uses_bcp

install()

__all__ = ["CheckpointOptions", "ENGINE_VARIABLE", "enable", "finish_pending", "install", "requested_engine",
           "uses_bcp"]
