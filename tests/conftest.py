import os
import shutil
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from pool import RankPool  # noqa: E402
from s3_fixtures import oidc_issuer, s3_env, s3_server, s3_url  # noqa: E402,F401  (fixtures for every folder)

_pools: dict[int, RankPool] = {}


def pytest_collection_modifyitems(items):
    for item in items:
        if "ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)``: the session's pool of ``n`` gloo ranks (created on first use)."""

    def get(n: int) -> RankPool:
        if n not in _pools:
            _pools[n] = RankPool(n)
        return _pools[n]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture
def memory_dir():
    """A fresh folder in memory (``/dev/shm``, where there is one), removed after the test. For
    tests whose short timeouts measure their ranks, not the disk: a durable write on disk can stall
    for seconds on a loaded machine (another write's journal commit), which such a timeout would
    mistake for a dead or hung rank; in memory, fsync returns at once."""
    path = tempfile.mkdtemp(prefix="bcp-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)
