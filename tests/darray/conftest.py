import multiprocessing.resource_tracker

import pytest


@pytest.fixture(scope="session", autouse=True)
def _resource_tracker():
    # multiprocessing's spawn context starts one resource-tracker process per
    # interpreter on first use; start it before the per-test leak check so the
    # first test does not count it as a leaked child.
    multiprocessing.resource_tracker.ensure_running()
    yield
