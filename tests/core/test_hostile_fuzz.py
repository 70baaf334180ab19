"""Seeded fuzzing of what a checkpoint's metadata may hold: the manifest, the shard table, the
commit marker and value records, mutated from a real checkpoint (wrong types, out-of-range and
int64-overflowing numbers, deep nesting, flipped, cut and appended bytes). Every case must either
parse or fail with a ``bcp.CheckpointError``; any other exception, a hang or unbounded memory is a
failure. Cases run in a child process whose address space is capped (``CappedChild``), so an
allocation a forged size asks for fails there (a ``MemoryError``, reported) instead of taking the
machine's memory; a case that hangs is cut off. A failure prints its seed and case number: rerun one
with ``_one_case(kind, seed, index, root)``."""

from __future__ import annotations

import copy
import json
import random
import shutil
import traceback
from pathlib import Path
from typing import Any, Callable

from crc32c import crc32c

import bcp
from bcp.engine.location import Location
from bcp.layout.manifest import Manifest
from bcp.layout.values import decode_value
from bcp.storage import LocalStorage
from bcp.tools.verify import verify_checkpoint
from hostile_forge import GEN, CappedChild, empty_state, files, make_checkpoint, sign_table, write_signed

SEED = 20261123
CASES = {"manifest": 1500, "table": 800, "marker": 400, "value": 800}
END_TO_END_EVERY = 10  # every 10th manifest/table case is also verified and loaded from disk
HANG_LIMIT_S = 300  # generous: the whole quick tier runs in a few seconds

_DEEP = "<5000 nested lists>"  # a string replaced by 5,000 nested brackets once the document is text
_HOSTILE = [None, True, False, -1, 0, 1, 7, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1,
            10**40, 1.5, -0.0, 1e308, float("inf"), float("nan"), "", "yesterday", "../../etc/passwd",
            "data/\u0000", "gen-00000001", [], {}, [0], [-1], [2**32, 2**32], [2**63], [2**64], [1] * 70,
            [0, 2**62], {"a": 1}, _DEEP]
_TAGS = ["$dict", "$tuple", "$set", "$frozenset", "$float", "$complex", "$bytes", "$bytearray", "$dtype",
         "$device", "$size", "$path", "$tensor", "$ndarray", "$npscalar", "$pickle", "$nope", "$", "dict"]


def test_fuzzed_metadata_fails_only_with_checkpoint_errors(tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    with CappedChild() as child:
        failures, counts = child.call(_fuzz_all, str(tmp_path / "ckpt"), SEED, timeout=HANG_LIMIT_S)
    assert counts == CASES
    assert not failures, f"{len(failures)} case(s) failed other than with a CheckpointError:\n" + "\n".join(failures[:20])


def _fuzz_all(root: str, seed: int) -> tuple[list[str], dict[str, int]]:
    failures, counts = [], {}
    for kind, n in CASES.items():
        counts[kind] = 0
        for index in range(n):
            failure = _one_case(kind, seed, index, root)
            counts[kind] += 1
            if failure:
                failures.append(failure)
    return failures, counts


def _one_case(kind: str, seed: int, index: int, root: str) -> str | None:
    """Run case ``index`` of ``kind``; a description of the failure, or None."""
    rng = random.Random(f"{seed}/{kind}/{index}")
    manifest, table, marker = files(Path(root))
    work = Path(root).with_name(f"work-{kind}")
    what = "?"
    try:
        if kind == "value":
            what, run = _value_case(rng, Path(root), manifest)
        elif kind == "marker":
            what, run = _marker_case(rng, work, root, marker)
        else:
            what, data, new_table = _manifest_case(rng, manifest, table) if kind == "manifest" else \
                _table_case(rng, manifest, table)
            run = _parse(data, new_table)
            if index % END_TO_END_EVERY == 0:
                run = _end_to_end(work, root, data, new_table)
        run()
    except bcp.CheckpointError:
        pass
    except BaseException as exc:  # noqa: BLE001 - every other exception is the finding
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return (f"{kind} case {index} (seed {seed}): {what[:200]} -> {type(exc).__name__}: {str(exc)[:200]} "
                f"at {Path(frame.filename).name}:{frame.lineno}")
    return None


def _parse(data: bytes, table: bytes) -> Callable[[], None]:
    def run() -> None:
        manifest = Manifest.decode(data, table, path="fuzz")
        for entry in manifest.tensors.values():
            entry.shards  # rows become entries lazily: build them all
        manifest.total_tensor_bytes()
    return run


def _end_to_end(work: Path, root: str, data: bytes, table: bytes) -> Callable[[], None]:
    """The forged metadata, signed, in a copy of the checkpoint: ``bcp verify`` and ``bcp.load``."""
    def run() -> None:
        if not work.exists():
            shutil.copytree(root, work)
        write_signed(work, data, table)
        try:
            verify_checkpoint(work)
        finally:
            bcp.load(work, empty_state())
    return run


def _manifest_case(rng: random.Random, manifest: bytes, table: bytes) -> tuple[str, bytes, bytes]:
    if rng.random() < 0.15:
        return _bytes_case(rng, manifest) + (table,)
    doc = json.loads(manifest)
    changes = _mutate(doc, rng)
    return changes, _text(doc), table


def _table_case(rng: random.Random, manifest: bytes, table: bytes) -> tuple[str, bytes, bytes]:
    doc = json.loads(manifest)
    raw = bytearray(table)
    op = rng.randrange(4)
    if op == 0:  # one int64 of the fixed-width columns set to a hostile number
        slot = rng.randrange(len(raw) // 8)
        value = rng.choice([-1, 0, 1, 2, 3, 2**31, 2**32, 2**62, 2**63 - 1, -2**63, rng.getrandbits(63)])
        raw[slot * 8: slot * 8 + 8] = value.to_bytes(8, "little", signed=True)
        what = f"int64 #{slot} = {value}"
    elif op == 1:
        at = rng.randrange(len(raw))
        raw[at] ^= 1 << rng.randrange(8)
        what = f"bit flip at {at}"
    elif op == 2:
        cut = rng.randrange(len(raw))
        raw = raw[:cut]
        what = f"cut to {cut} bytes"
    else:
        extra = rng.randbytes(rng.choice([1, 4, 8, 64]))
        raw += extra
        what = f"{len(extra)} bytes appended"
    if rng.random() < 0.3:  # and the manifest's count or ndim changed to match some other layout
        key = rng.choice(["count", "ndim"])
        doc["shard_table"][key] = rng.choice([0, 1, 2, 3, 4, 2**20, 2**40, 2**62, -1])
        what += f", {key} = {doc['shard_table'][key]}"
    table = bytes(raw)
    sign_table(doc, table)
    return what, _text(doc), table


def _marker_case(rng: random.Random, work: Path, root: str, marker: bytes) -> tuple[str, Callable[[], None]]:
    if rng.random() < 0.2:
        what, data = _bytes_case(rng, marker)
    else:
        doc = json.loads(marker)
        what = _mutate(doc, rng)
        data = _text(doc)

    def run() -> None:
        if not work.exists():
            shutil.copytree(root, work)
        (work / GEN / "COMMITTED").write_bytes(data)
        location = Location(LocalStorage(work), "", str(work))
        Manifest.decode(*location.read_manifest_files(1), path=str(work))
    return what, run


def _value_case(rng: random.Random, root: Path, manifest: bytes) -> tuple[str, Callable[[], None]]:
    """A value record whose tree is mutated (tags and bodies); its blobs stay as saved."""
    file, offset, nbytes, tree_nbytes, _ = json.loads(manifest)["objects"]["extra_state"]["records"][0]
    with open(root / GEN / json.loads(manifest)["files"][file], "rb") as f:
        f.seek(offset)
        record = f.read(nbytes)
    tree = json.loads(record[:tree_nbytes])
    what = _mutate(tree, rng, tags=True)
    data = _text(tree)
    blobs = record[tree_nbytes:]
    if rng.random() < 0.2:
        blobs = blobs[: rng.randrange(len(blobs) + 1)]
        what += f", blobs cut to {len(blobs)} bytes"
    payload = memoryview(data + blobs)
    return what, lambda: decode_value(payload, len(data), key="extra_state", path="fuzz")


def _bytes_case(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    raw = bytearray(data)
    op = rng.randrange(3)
    if op == 0:
        at = rng.randrange(len(raw))
        raw[at] = rng.randrange(256)
        return f"byte {at} = {raw[at]}", bytes(raw)
    if op == 1:
        cut = rng.randrange(len(raw))
        return f"cut to {cut} bytes", bytes(raw[:cut])
    return "garbage appended", bytes(raw) + rng.randbytes(rng.randrange(1, 64))


def _mutate(doc: Any, rng: random.Random, tags: bool = False) -> str:
    """Change one to three places of a JSON document in place; says what it did."""
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        places = list(_places(doc))
        if not places:
            break
        parent, key = rng.choice(places)
        op = rng.random()
        if op < 0.1 and isinstance(parent, dict):
            del parent[key]
            done.append(f"deleted {key!r}")
            continue
        if op < 0.2:
            parent[key] = [parent[key]]
        elif tags and op < 0.5:
            parent[key] = {rng.choice(_TAGS): rng.choice([copy.deepcopy(parent[key]), rng.choice(_HOSTILE)])}
        else:
            parent[key] = copy.deepcopy(rng.choice(_HOSTILE))
        done.append(f"{key!r} = {str(parent[key])[:60]}")
    return "; ".join(done)


def _places(node: Any):
    """Every (container, key) of a JSON document."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        yield node, key
        yield from _places(value)


def _text(doc: Any) -> bytes:
    return json.dumps(doc).replace(json.dumps(_DEEP), "[" * 5000 + "]" * 5000).encode()


def test_a_case_is_reproducible_from_its_seed(tmp_path):
    root = str(make_checkpoint(tmp_path / "ckpt"))
    first = [_manifest_case(random.Random(f"{SEED}/manifest/{i}"), *files(Path(root))[:2]) for i in range(20)]
    again = [_manifest_case(random.Random(f"{SEED}/manifest/{i}"), *files(Path(root))[:2]) for i in range(20)]
    assert first == again and len({crc32c(data) for _, data, _ in first}) > 10
