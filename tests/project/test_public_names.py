"""Every package's ``__all__`` is what it says: each name it lists imports, and ``from package import *``
(which reads ``__all__``) works."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = ["bcp", "bcp.integration", "bcp_lightning", "bcp_accelerate", "bcp_megatron"]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_of_all_imports(name):
    package = importlib.import_module(name)
    missing = [public for public in package.__all__ if not hasattr(package, public)]
    assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
    assert len(set(package.__all__)) == len(package.__all__), f"{name}.__all__ lists a name twice"


@pytest.mark.parametrize("name", PACKAGES)
def test_star_import_works(name):
    imported: dict[str, object] = {}
    exec(f"from {name} import *", imported)
    package = importlib.import_module(name)
    assert {public: imported[public] for public in package.__all__} == \
        {public: getattr(package, public) for public in package.__all__}
