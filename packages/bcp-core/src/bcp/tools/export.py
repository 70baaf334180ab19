"""``bcp export --to safetensors``: a Hugging Face style folder from one component of a checkpoint.

Tensors are read whole, one at a time, straight from the shards they were saved in (whatever the
parallel layout), cast if asked, and streamed into the file, so memory holds about one tensor,
never the model. Files are ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json`` when the size limit splits them, as ``save_pretrained`` writes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch

from bcp.engine.bytes_of import byte_view, host_contiguous
from bcp.errors import CheckpointError, MismatchError
from bcp.layout.dtypes import dtype_from_name, itemsize
from bcp.layout.manifest import TensorEntry
from bcp.tools.checkpoint import Checkpoint, open_checkpoint
from bcp.tools.hf_ties import config_file, tied_groups
from bcp.tools.paths import check_new_local_output
from bcp.tools.progress import NoProgress, Progress
from bcp.tools.rules import CastRules, NameRules
from bcp.tools.safetensors_format import encode_header
from bcp.tools.units import parse_size

INDEX_NAME = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass
class ExportResult:
    out: str
    files: list[str]
    tensors: int
    total_bytes: int
    #: Tied names left out (the model shares them with the kept name): dropped -> kept.
    tied: dict[str, str] = field(default_factory=dict)
    #: Non-tensor entries of the component, which safetensors cannot hold.
    skipped_values: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Tensor:
    source: str  # full name in the checkpoint
    name: str  # name in the safetensors file
    dtype: torch.dtype
    entry: TensorEntry

    @property
    def nbytes(self) -> int:
        return math.prod(self.entry.shape) * itemsize(self.dtype)


def export_safetensors(path: "str | os.PathLike", out: "str | os.PathLike", *, component: str = "model",
                       role: str | None = None, max_shard_size: int | str = "5GB", rules: NameRules = NameRules(),
                       casts: CastRules = CastRules(), config: "str | os.PathLike | None" = None,
                       keep_tied: bool = False, overwrite: bool = False,
                       progress: Progress | None = None) -> ExportResult:
    """Export ``component`` of the checkpoint at ``path`` into the folder ``out``.

    ``rules`` and ``casts`` patterns see names as written to the files (without ``component/``).
    ``config`` (a model folder or ``config.json``) is copied next to the weights, and with
    ``transformers`` installed it tells which weights are tied: those are written once, as
    ``save_pretrained`` does, unless ``keep_tied``. ``overwrite`` replaces safetensors files
    already in ``out``; other files there (a tokenizer, say) are kept.
    """
    checkpoint = open_checkpoint(path, role=role)
    target = check_new_local_output(out, [checkpoint.location.storage.root], what="safetensors exports",
                                    may_exist=True)
    limit = parse_size(max_shard_size)
    tensors, skipped = _select(checkpoint, component, rules, casts)
    tied = {} if keep_tied or config is None else _tied(checkpoint, tensors, config)
    tensors = [t for t in tensors if t.name not in tied]
    _clear(target, overwrite)

    groups = _shards(tensors, limit)
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    progress = progress or NoProgress()
    progress.start("export", sum(t.nbytes for t in tensors))
    try:
        for name, group in zip(names, groups):
            _write_file(checkpoint, os.path.join(target, name), group, progress)
    finally:
        progress.finish()
    total = sum(t.nbytes for t in tensors)
    if len(groups) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: n for n, g in zip(names, groups) for t in g}}
        _write_json(os.path.join(target, INDEX_NAME), index)
    if config is not None:
        _copy_config(config, target)
    return ExportResult(target, names, len(tensors), total, tied, skipped)


def _select(checkpoint: Checkpoint, component: str, rules: NameRules,
            casts: CastRules) -> tuple[list[_Tensor], list[str]]:
    prefix = component + "/"
    names = [n for n in checkpoint.tensors if n.startswith(prefix)]
    skipped = [n for n in checkpoint.objects if n.startswith(prefix)]
    if not names:
        present = sorted(checkpoint.manifest.components())
        raise CheckpointError(f"component {component!r} holds no tensors; components: {present}", path=checkpoint.path)
    renamed = rules.apply(n[len(prefix):] for n in names)
    if not renamed:
        raise CheckpointError(f"the rules leave no tensor of component {component!r} to export", path=checkpoint.path)
    selected = []
    for short, new in renamed.items():
        entry = checkpoint.tensors[prefix + short]
        selected.append(_Tensor(prefix + short, new, casts.dtype_for(short, dtype_from_name(entry.dtype)), entry))
    return selected, skipped


def _tied(checkpoint: Checkpoint, tensors: list[_Tensor], config: "str | os.PathLike") -> dict[str, str]:
    """Exported names to leave out because the model ties them to another exported name."""
    by_name = {t.name: t for t in tensors}
    dropped: dict[str, str] = {}
    for group in tied_groups(config) or []:
        present = [name for name in group if name in by_name]
        for name in present[1:]:
            kept, other = by_name[present[0]], by_name[name]
            if not _same_values(checkpoint, kept, other):
                raise MismatchError(
                    f"the model config ties {name!r} to {present[0]!r}, but the checkpoint holds different "
                    "values for them; check the config, or pass keep_tied (--keep-tied) to export both",
                    path=checkpoint.path, key=name)
            dropped[name] = present[0]
    return dropped


def _same_values(checkpoint: Checkpoint, a: _Tensor, b: _Tensor) -> bool:
    if (a.entry.dtype, a.entry.shape, a.dtype) != (b.entry.dtype, b.entry.shape, b.dtype):
        return False
    layout = sorted((s.box.offsets, s.box.lengths, s.bytes.crcs) for s in a.entry.shards)
    if layout == sorted((s.box.offsets, s.box.lengths, s.bytes.crcs) for s in b.entry.shards):
        return True
    return torch.equal(checkpoint.read(a.source), checkpoint.read(b.source))


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Consecutive tensors up to ``limit`` bytes per file (a larger tensor gets a file of its own)."""
    groups: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups


def _write_file(checkpoint: Checkpoint, path: str, group: list[_Tensor], progress: Progress) -> None:
    # Largest element size first keeps every tensor aligned to its element size, as the reference writer does.
    group = sorted(group, key=lambda t: -itemsize(t.dtype))
    prefix, _ = encode_header([(t.name, t.dtype, t.entry.shape) for t in group], {"format": "pt"})
    partial = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(prefix)
            for t in group:
                data = byte_view(host_contiguous(checkpoint.read(t.source).to(t.dtype)))
                f.write(data)
                progress.advance(data.nbytes)
                del data
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise


def _clear(target: str, overwrite: bool) -> None:
    os.makedirs(target, exist_ok=True)
    existing = sorted(n for n in os.listdir(target) if n.endswith(".safetensors") or n == INDEX_NAME)
    if existing and not overwrite:
        raise CheckpointError(f"{target!r} already holds {existing}; pass overwrite (--overwrite) to replace them")
    for name in existing:
        os.unlink(os.path.join(target, name))


def _copy_config(config: "str | os.PathLike", target: str) -> None:
    source = config_file(config)
    shutil.copyfile(source, os.path.join(target, "config.json"))
    folder = os.path.dirname(source)
    for name in CONFIG_FILES[1:]:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(target, name))


def _write_json(path: str, doc: Any) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")
