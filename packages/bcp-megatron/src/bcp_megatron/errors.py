"""bcp's errors as Megatron sees them: every error leaving a bcp strategy is also a
``megatron.core.dist_checkpointing.core.CheckpointingException``.

Megatron-LM and Megatron-Core's own code catch ``CheckpointingException`` around
``dist_checkpointing.save``/``load``; bcp's callers catch ``bcp.CheckpointError`` (or a subclass
such as ``bcp.MismatchError``). At the strategy boundary each bcp error's class is swapped for one
deriving from both its own class and Megatron's, so both ``except`` clauses see it, with its
message (naming the checkpoint and the entry), attributes and traceback unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from megatron.core.dist_checkpointing.core import CheckpointingException

import bcp


def _megatron_class(cls: type) -> type:
    """``cls`` (a ``bcp.CheckpointError`` class) and ``CheckpointingException`` in one class, kept in
    this module under ``cls``'s name so that the error pickles (Megatron's checkpoint worker)."""
    module = sys.modules[__name__]
    both = module.__dict__.get(cls.__name__)
    if both is None or both.__bases__ != (cls, CheckpointingException):
        both = type(cls.__name__, (cls, CheckpointingException),
                    {"__module__": __name__, "__qualname__": cls.__name__,
                     "__doc__": f"``bcp.{cls.__name__}`` that is also Megatron's ``CheckpointingException``."})
        setattr(module, cls.__name__, both)
    return both


@contextlib.contextmanager
def as_megatron_errors() -> Iterator[None]:
    """Re-raise every ``bcp.CheckpointError`` of the block as also a ``CheckpointingException``
    (usable as a decorator on strategy methods)."""
    try:
        yield
    except bcp.CheckpointError as error:
        if not isinstance(error, CheckpointingException):
            error.__class__ = _megatron_class(type(error))
        raise


# The classes of bcp's public errors exist from import on, so an error pickled in one process
# unpickles in another that has not raised one yet.
for _name in bcp.__all__:
    _value = getattr(bcp, _name)
    if isinstance(_value, type) and issubclass(_value, bcp.CheckpointError):
        _megatron_class(_value)
