"""``bcp convert --from hf``: a Hugging Face safetensors folder (or one file) into a bcp checkpoint
whose ``model`` component ``bcp.load`` reshards into any live layout (FSDP2, TP, ...).

Tensors stream one at a time from the safetensors files into the new checkpoint. Weights the model
ties (the folder holds them once) become entries sharing the stored bytes, so a strict
``bcp.load`` of the live model, which names every tied weight, finds them all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping

from bcp.chunk_codecs import Compression
from bcp.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from bcp.layout.box import Box
from bcp.tools.build import PieceSource, write_checkpoint
from bcp.tools.hf_ties import tied_groups
from bcp.tools.progress import Progress
from bcp.tools.rules import CastRules, NameRules
from bcp.tools.safetensors_format import SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class HfConvertResult:
    out: str
    generation: int
    tensors: int
    #: Tied names added as entries sharing another tensor's bytes: alias -> written name.
    tied: dict[str, str] = field(default_factory=dict)


def convert_hf_to_bcp(src: "str | os.PathLike", out: "str | os.PathLike", *, component: str = "model",
                      rules: NameRules = NameRules(), casts: CastRules = CastRules(),
                      ties: Mapping[str, str] | None = None, compression: "Compression | str | bool | None" = None,
                      progress: Progress | None = None) -> HfConvertResult:
    """Convert the safetensors weights at ``src`` into a new checkpoint at ``out``.

    Entries are named ``<component>/<key>``; ``rules`` and ``casts`` patterns see those names.
    ``ties`` maps a missing key to the key it shares a tensor with (``{"lm_head.weight":
    "model.embed_tokens.weight"}``); by default they come from ``src``'s ``config.json`` when
    ``transformers`` is installed. Pass ``{}`` to add none. ``compression``: the codec the data is
    stored with (None: uncompressed), as ``bcp.save`` takes it.
    """
    if not component or "/" in component:
        raise CheckpointError(f"a component name is non-empty and has no '/': {component!r}")
    files = [SafetensorsFile(f) for f in safetensors_files(src)]
    source_of: dict[str, SafetensorsFile] = {}
    for file in files:
        for key in file.entries:
            if key in source_of:
                raise CorruptCheckpointError(f"tensor {key!r} is in both {source_of[key].path} and {file.path}")
            source_of[key] = file
    if ties is None:
        ties = _config_ties(src, source_of)
    for alias, key in ties.items():
        if key not in source_of:
            raise CheckpointError(f"cannot tie {alias!r} to {key!r}: the folder holds no {key!r}")

    prefix = component + "/"
    names = rules.apply([prefix + key for key in source_of] + [prefix + alias for alias in ties])
    pieces = []
    for key, file in source_of.items():
        if prefix + key not in names:
            continue
        entry = file.entries[key]
        dtype = casts.dtype_for(prefix + key, entry.dtype)
        pieces.append(PieceSource(names[prefix + key], dtype, entry.shape, Box.whole(entry.shape),
                                  lambda file=file, key=key, dtype=dtype: file.read(key).to(dtype)))
    aliases = {names[prefix + alias]: names[prefix + key] for alias, key in ties.items()
               if prefix + alias in names and prefix + key in names}
    generation = write_checkpoint(out, pieces, [], note="converted from safetensors", aliases=aliases,
                                  sources=[src], compression=compression, progress=progress)
    return HfConvertResult(os.fspath(out), generation, len(pieces), aliases)


def safetensors_files(src: "str | os.PathLike") -> list[str]:
    """The weight files of a folder: those its index names, else ``model.safetensors``, else every
    ``*.safetensors``; or ``src`` itself when it is a file."""
    src = os.fspath(src)
    if os.path.isfile(src):
        return [src]
    if not os.path.isdir(src):
        raise CheckpointNotFoundError("no such file or folder", path=src)
    index = os.path.join(src, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"unreadable {INDEX_NAME} ({exc!r})", path=src) from None
        if not all(isinstance(n, str) and os.path.basename(n) == n for n in names):
            raise CorruptCheckpointError(f"{INDEX_NAME} names files outside the folder", path=src)
        return [os.path.join(src, n) for n in names]
    found = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if "model.safetensors" in found:
        return [os.path.join(src, "model.safetensors")]
    if not found:
        pickled = [n for n in os.listdir(src) if n.endswith((".bin", ".pt", ".pth"))]
        hint = f" ({', '.join(pickled)} are pickles, which bcp does not read)" if pickled else ""
        raise CheckpointNotFoundError(f"no safetensors files in the folder{hint}", path=src)
    return [os.path.join(src, n) for n in found]


def _config_ties(src: "str | os.PathLike", present: Mapping[str, object]) -> dict[str, str]:
    """Tied names the folder leaves out, each mapped to the tied name it holds."""
    config = os.path.join(os.fspath(src), "config.json")
    groups = tied_groups(config) if os.path.isfile(config) else None
    ties = {}
    for group in groups or []:
        held = [name for name in group if name in present]
        ties.update({name: held[0] for name in group if held and name not in present})
    return ties
