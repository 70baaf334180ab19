"""The environment variable that chooses Accelerate's checkpoint engine; it imports nothing, so that
both the switch and the engine can name it."""

#: ``bcp`` routes ``save_state``/``load_state`` through bcp, ``accelerate`` keeps accelerate's own
#: engine. The ``.pth`` line of ``bcp_accelerate_build`` spells the same name.
ENGINE_VARIABLE = "ACCELERATE_CHECKPOINT_ENGINE"
