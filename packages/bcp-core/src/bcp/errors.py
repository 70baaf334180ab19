"""The one exception hierarchy of bcp. Every failure a user can cause or meet derives from
:class:`CheckpointError`, so ``except bcp.CheckpointError`` is enough around ``save``/``load``."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every bcp error. ``path`` names the checkpoint, ``key`` the tensor or entry."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        self.message = message
        self.path = path
        self.key = key
        super().__init__(self._formatted())

    def at(self, path: str) -> "CheckpointError":
        """This error, naming checkpoint ``path`` if it named none (raised where the path is unknown,
        as in an adapter)."""
        if self.path is None:
            self.path = path
            self.args = (self._formatted(),)
        return self

    def _formatted(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"checkpoint {self.path!r}")
        if self.key is not None:
            where.append(f"entry {self.key!r}")
        return f"{self.message} ({', '.join(where)})" if where else self.message


class CheckpointNotFoundError(CheckpointError):
    """The path does not exist or holds no bcp checkpoint."""


class CheckpointNotCommittedError(CheckpointError):
    """The checkpoint was started but never committed (a save that failed or was interrupted)."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written in a format version this bcp cannot read."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match their checksum, or a file is truncated or unreadable."""


class StorageError(CheckpointError):
    """The storage backend failed to write, read, list or delete (disk full, permission, network)."""


class MismatchError(CheckpointError):
    """The live state and the checkpoint disagree: shape, dtype, keys or structure."""


class UnsupportedValueError(CheckpointError):
    """A value cannot be stored in bcp's safe encoding (and unsafe pickling was not allowed)."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint holds pickled values and the caller did not opt in to unpickling them."""


class AdapterError(CheckpointError):
    """No adapter matches the state, or the requested framework does not match the objects."""


class DistributedError(CheckpointError):
    """One or more ranks failed; the message carries each failing rank's error."""


class SaveAbandonedError(CheckpointError):
    """An asynchronous save was abandoned before its commit (a second Ctrl-C while the process waited
    for it at exit, or ``bcp.shutdown(abandon=True)``); its uncommitted files are removed."""
