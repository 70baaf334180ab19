import logging

import pytest


@pytest.fixture
def storage_log(caplog):
    caplog.set_level(logging.WARNING, logger="bcp.storage")
    return caplog
