"""bcp for Hugging Face Accelerate: ``accelerator.save_state()``/``load_state()`` through bcp.

Every prepared model and optimizer is saved once, in parallel, and loads into any number of
processes and any layout; registered objects are stored by bcp too, and accelerate's own files
(schedulers, samplers, RNG) are written by accelerate and committed with them. Three ways to switch it on:

- ``ACCELERATE_CHECKPOINT_ENGINE=bcp`` in the environment (every accelerator, no code change: the
  installed ``bcp_accelerate_autoload.pth`` imports this package once accelerate is imported);
- ``bcp_accelerate.enable(accelerator)``;
- ``bcp_accelerate.Accelerator`` in place of ``accelerate.Accelerator``.

Importing this package makes ``accelerate.Accelerator.save_state``/``load_state`` consult the
switch on each call; while it is off they are accelerate's own, unchanged.
"""

from bcp_accelerate.accelerator import Accelerator
from bcp_accelerate.switch import ENGINE_VARIABLE, enable, install, requested_engine, uses_bcp

install()

__all__ = ["Accelerator", "ENGINE_VARIABLE", "enable", "install", "requested_engine", "uses_bcp"]
