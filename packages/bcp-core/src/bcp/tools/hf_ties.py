"""Tied weights of a Hugging Face model (e.g. the output projection sharing the input embedding),
found from its config by building the model on the meta device and grouping parameter names that
share one tensor. A checkpoint of the live model holds each tied weight under every name; a
safetensors folder holds it once. ``transformers`` is optional: without it, no ties are known."""

from __future__ import annotations

import json
import os

import torch

from bcp.errors import CheckpointError


def config_file(path: "str | os.PathLike") -> str:
    """``config.json`` of a model folder, or the given file."""
    path = os.fspath(path)
    found = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(found):
        raise CheckpointError(f"no model config at {found!r}")
    return found


def tied_groups(config_path: "str | os.PathLike") -> list[list[str]] | None:
    """Names of each group of parameters sharing one tensor (the first name is the one the model
    registers first, which Hugging Face keeps); None when the config names no ``transformers``
    model class (or ``transformers`` is missing)."""
    try:
        import transformers
    except ImportError:
        return None
    with open(config_file(config_path)) as f:
        settings = json.load(f)
    architectures = settings.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)
            and "model_type" in settings):
        return None  # unknown here (e.g. a remote-code architecture): ties cannot be told
    config = transformers.AutoConfig.for_model(**settings)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = model_class(config)
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]
