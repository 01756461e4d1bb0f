"""Suite-wide pytest hooks.

``@pytest.mark.host_noise``: checks whose outcome depends on how quiet the host's CPUs are (a 1.2x slowdown
found among 4 ranks time-sharing 2 cores, 100 clean steps without an alarm, a calibrated step prediction within
20%). On a shared CI machine they fail now and then for reasons outside the code, so ``make test`` skips them,
saying so in its summary; run them with ``MOONEP_HOST_NOISE_TESTS=1 make test`` (or pytest) on a machine you
trust. Their measured pass rates are in tools/README.md and simulator/README.md.
"""
import os

import pytest

HOST_NOISE_ENV = "MOONEP_HOST_NOISE_TESTS"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(HOST_NOISE_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"depends on a quiet host; set {HOST_NOISE_ENV}=1 to run")
    for item in items:
        if "host_noise" in item.keywords:
            item.add_marker(skip)
