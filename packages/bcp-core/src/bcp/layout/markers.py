"""The two small JSON files of a generation beside its manifest (``docs/format.md``): the ``CLAIM``
a writer creates first (create-if-absent, so two writers never share a generation) and the
``COMMITTED`` marker that makes the generation visible. Each is a record with one writer and one
parser here; the JSON keys are those every bcp version wrote, and a parser reads what older
versions wrote (fields they did not write take their defaults)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bcp.errors import CorruptCheckpointError, FormatVersionError
from bcp.layout.manifest import FORMAT_NAME, MARKER_VERSION

# A marker is ~150 bytes; a manifest, columnar, is a few MB at thousands of ranks. What a hostile
# marker may claim is bounded before anything is read.
MAX_MARKER_BYTES = 4096
MAX_MANIFEST_BYTES = 256 << 20
#: The claim's key set in a failed save's generation whose files are removed (``Location.discard``).
DISCARDED = "discarded"
_CLAIM_KEYS = ("host", "pid", "unix", "token", "base", DISCARDED)


@dataclass(frozen=True, slots=True)
class Claim:
    """A generation's claim: who made it (host, pid, time; a memory tier's names only the pid), its
    token, the base an incremental save may refer to, whether a failed save's remains are
    discarded, and any keys a newer bcp added (kept when the claim is rewritten)."""

    token: str | None = None
    base: int | None = None
    host: str | None = None
    pid: int | None = None
    unix: float | None = None
    discarded: bool = False
    others: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> bytes:
        fields = {"host": self.host, "pid": self.pid, "unix": self.unix, "token": self.token, "base": self.base}
        doc = {key: value for key, value in fields.items() if value is not None}
        if self.discarded:
            doc[DISCARDED] = True
        return json.dumps({**doc, **self.others}).encode()

    def marked_discarded(self) -> "Claim":
        """The claim of a failed save's generation whose files are removed."""
        return Claim(self.token, self.base, self.host, self.pid, self.unix, True, self.others)

    @staticmethod
    def from_json(data: bytes) -> "Claim | None":
        """The claim ``data`` holds; None where it is not one (not JSON, not an object). A field of
        the wrong type reads as absent."""
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None
        base, pid, unix = doc.get("base"), doc.get("pid"), doc.get("unix")
        return Claim(_typed(doc.get("token"), str), base if type(base) is int and base > 0 else None,
                     _typed(doc.get("host"), str), pid if type(pid) is int else None,
                     unix if type(unix) in (int, float) else None, doc.get(DISCARDED) is True,
                     {key: value for key, value in doc.items() if key not in _CLAIM_KEYS})


@dataclass(frozen=True, slots=True)
class CommitMarker:
    """A generation's commit marker: the manifest's size and crc32c (a load checks the manifest
    against them) and the generation it commits."""

    generation: int
    manifest_bytes: int
    manifest_crc32c: int

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT_NAME, "version": MARKER_VERSION, "generation": self.generation,
                           "manifest_bytes": self.manifest_bytes, "manifest_crc32c": self.manifest_crc32c}).encode()

    @staticmethod
    def parse(data: bytes, generation: int, where: str) -> "CommitMarker":
        """The marker of ``generation``, each field checked for type and range; a clear error
        naming ``where`` otherwise."""
        try:
            marker = json.loads(data)
        except (ValueError, RecursionError):
            raise CorruptCheckpointError("commit marker is not valid JSON", path=where) from None
        if not isinstance(marker, dict) or marker.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError("commit marker is not a bcp marker", path=where)
        version = marker.get("version")
        if type(version) is not int or version != MARKER_VERSION:
            raise FormatVersionError(f"commit marker of format version {version!r}; this bcp reads "
                                     f"({MARKER_VERSION},)", path=where)
        if type(marker.get("generation")) is not int or marker["generation"] != generation:
            raise CorruptCheckpointError(f"commit marker names generation {marker.get('generation')!r}, "
                                         f"not {generation}", path=where)
        size, crc = marker.get("manifest_bytes"), marker.get("manifest_crc32c")
        if type(size) is not int or not 0 < size <= MAX_MANIFEST_BYTES or type(crc) is not int \
                or not 0 <= crc < 2**32:
            raise CorruptCheckpointError("commit marker's manifest size or checksum is out of range", path=where)
        return CommitMarker(generation, size, crc)


def _typed(value: Any, kind: type) -> Any:
    return value if isinstance(value, kind) else None
