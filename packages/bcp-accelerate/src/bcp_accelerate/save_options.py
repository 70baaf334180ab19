"""How an accelerator's ``save_state`` calls ``bcp.save`` beyond what a folder keeps
(``generations``), as ``bcp_accelerate.enable`` set it: compression (folders and tiers), and
asynchronous, overlapped saves (into a tier only: a folder's clean-up and ``total_limit`` follow its
commit)."""

from __future__ import annotations

from typing import Any

import bcp

_ATTRIBUTE = "_bcp_save_options"


def set_options(accelerator: Any, *, async_save: bool, overlap: bool,
                compression: "bcp.Compression | str | bool | None") -> None:
    if type(async_save) is not bool or type(overlap) is not bool:
        raise TypeError(f"async_save and overlap must be True or False, got {async_save!r} and {overlap!r}")
    setattr(accelerator, _ATTRIBUTE, bcp.SaveOptions(async_save=async_save, overlap=overlap, compression=compression))


def for_tier(accelerator: Any) -> bcp.SaveOptions:
    return getattr(accelerator, _ATTRIBUTE, None) or bcp.SaveOptions()


def for_folder(accelerator: Any) -> bcp.SaveOptions:
    """A folder is saved synchronously: only the compression applies."""
    return bcp.SaveOptions(compression=for_tier(accelerator).compression)
