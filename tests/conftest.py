import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

# CI is derandomized: the same examples every run, so a submission's CI result does not depend
# on luck; the "dev" and "thorough" profiles draw new examples each run to keep hunting.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402


@pytest.fixture
def device_path():
    """Steps on the CPU take the device path of the non-finite skip (what a GPU runs), which they
    otherwise read back on the host (`modopt.core.runner.device_path`)."""
    from modopt.core import runner

    with runner.device_path():
        yield
