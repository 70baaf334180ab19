"""Options of ``save`` and ``load``: one frozen object each, which integrations hold and pass through
instead of repeating keyword lists. ``bcp.save(path, state, async_save=True)`` and
``bcp.save(path, state, SaveOptions(async_save=True))`` are the same call."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from bcp.chunk_codecs import Compression
from bcp.coord import Coordinator
from bcp.engine.location import DEFAULT_KEEP_GENERATIONS
from bcp.errors import CheckpointError

DEFAULT_IO_THREADS = 4

_Options = TypeVar("_Options", bound="_CommonOptions")


@dataclass(frozen=True, slots=True, kw_only=True)
class _CommonOptions:
    """What saving and loading share."""

    framework: str | None = None
    """Adapter to use for ``model``/``optimizer`` (default: detected from the objects)."""
    role: str | None = None
    """A name under the path (``<path>/<role>/``), for checkpoints saved side by side."""
    coordinator: Coordinator | str | None = None
    """How ranks exchange plans: a Coordinator, or a name (``"torch"``, ``"grpc"``); default: the
    ``BCP_COORDINATOR`` variable's, else the world's process group, or a single process."""
    allow_pickle: bool = False
    """Saving: pickle values outside the safe encoding (the checkpoint is then marked unsafe).
    Loading: allow values that were saved so (never needed for bcp's safe encoding)."""
    io_threads: int = DEFAULT_IO_THREADS
    """Writer or reader threads per rank, at most."""
    topology: Mapping[str, int] | None = None
    """This rank's coordinates in the parallel topology (e.g. ``{"dp": 1, "tp": 0, "pp": 2}``), kept
    in the operation's metrics record so that reports lay ranks out by them."""
    metrics_log: "bool | str | os.PathLike" = True
    """Where the coordinating rank logs the operation's metrics record (one JSON line): beside the
    checkpoints, under ``<path>/bcp-metrics/`` (``True``, the default), appended to the given local
    file, or nowhere (``False``)."""
    summary_log_level: int = logging.INFO
    """The level of the one-line summary the coordinating rank logs on the ``bcp`` logger after each
    operation (a failure is always a WARNING). Integrations whose framework logs routine work at
    DEBUG (Megatron-Core) pass ``logging.DEBUG``."""

    def merged(self: _Options, keywords: Mapping[str, Any]) -> _Options:
        """These options with ``keywords`` replacing fields; an unknown keyword is a TypeError, as
        for any call."""
        if not keywords:
            return self
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(keywords) - fields)
        if unknown:
            raise TypeError(f"got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                            f"the options are {', '.join(sorted(fields))}")
        return dataclasses.replace(self, **keywords)


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions(_CommonOptions):
    """How ``bcp.save`` saves."""

    async_save: bool = False
    """Return once the state is copied to host memory; the handle's ``wait()`` returns when committed."""
    async_writer: str = "process"
    """Who writes an asynchronous save's files: ``"process"``, bcp's writer process, fed from shared
    memory, beside the training process (its checksums and writes never take the training thread's
    interpreter lock; at most 2 files at once, at a low priority); or ``"threads"``, ``io_threads``
    threads of the training process at a lower priority. Storages another process cannot reach
    (``memory://``, S3) and platforms without shared memory by descriptor (not Linux) use threads."""
    overlap: bool = False
    """With ``async_save``: return before the parameters that the state's optimizers step, and their
    state, are copied to host memory; the copy overlaps the next forward and backward, and those
    optimizers wait for it before they step (code that writes them otherwise calls
    ``handle.wait_snapshot()`` first). The snapshot is still the state at the call
    (``docs/guarantees.md``)."""
    overlap_optimizers: tuple[Any, ...] = ()
    """With ``overlap``: optimizers that step tensors of the state although the state holds their
    state as a dict (parameters named as the integrations name them), not the optimizer objects; they
    wait for the copy before they step, as the state's own optimizers do. Without them the tensors of
    such a dict are copied at the call."""
    verify_replicas: bool = False
    """Check, by checksum, that replicated tensors agree across ranks."""
    keep_generations: int = DEFAULT_KEEP_GENERATIONS
    """Committed generations kept at the path after each save (at least 1): a reader of the previous
    one is not broken by the next save's retention. Generations whose files a kept one refers to
    (``incremental``) are kept too."""
    step: int | None = None
    """The training step this save is taken at (a non-negative integer), recorded in the generation's
    manifest and listed by ``bcp inspect``; the integrations set it. Only the coordinating rank's is kept."""
    incremental: bool = False
    """Write only what changed: a box of a tensor whose bytes the newest committed generation at the
    path stores already is not written again, the new generation refers to those bytes (format
    version 3; every generation still loads, verifies and reshards on its own). How bcp decides
    "unchanged": ``docs/incremental.md``."""
    trust_frozen: bool = True
    """With ``incremental``: a frozen parameter (``requires_grad=False``) whose memory and version
    counter are as when this process saved it is not read (one 1 MiB chunk of it is checked). False:
    every piece's bytes are checksummed, for code that writes frozen parameters behind torch's back
    (through ``.data`` or NumPy)."""
    compression: Compression | str | bool | None = None
    """Compress the tensors' bytes losslessly, each checksum chunk on its own: ``"zstd"`` (or
    ``True``, or ``bcp.Compression(level=...)``; floating-point data coded in byte planes); a chunk
    that does not shrink is stored raw. Runs on the writer threads after staging, so an asynchronous
    save blocks no longer. Off by default (format version 4 where on; docs/format.md). None (not
    named) saves into a ``bcp.MemoryTier`` with the tier's own ``compression``; ``False`` names "none":
    uncompressed there too. Kept as a ``bcp.Compression``, ``False`` or None."""

    def __post_init__(self) -> None:
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0):
            raise CheckpointError(f"step must be a non-negative int (the training step), got {self.step!r}")
        try:  # kept as the record it names, so every reader of the options sees one type
            if self.compression is not False:  # False stays: "none", named, which a tier's own does not replace
                object.__setattr__(self, "compression", Compression.of(self.compression))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions(_CommonOptions):
    """How ``bcp.load`` loads."""

    strict: bool = True
    """Every requested entry must be saved and every saved entry of a requested component requested."""
    verify: bool = True
    """Check every byte read against its checksum."""
    read_once: bool = False
    """Bytes that several ranks need are read by one of them and sent to the others."""
    transactional: bool = True
    """Read into staging memory and place into the live tensors only once every rank has read and
    verified everything: a failed load leaves the live state as it was (at the cost of one copy)."""
    cast_dtype: bool = False
    """A saved tensor whose dtype differs from the live tensor's is converted to the live dtype (by
    torch's ``copy_``, through a staging copy in the saved dtype). Off, such a tensor is a
    ``MismatchError`` naming it and both dtypes. For frameworks whose contract casts (Megatron's)."""
    generation: int | None = None
    """Load this kept generation (``bcp inspect`` lists them) instead of the newest committed one: a
    roll back after a loss spike. How many are kept is ``SaveOptions.keep_generations``."""
