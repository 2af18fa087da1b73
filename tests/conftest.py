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

# The test lanes (docs/testing.md). A test marked with one of these runs when its lane is
# asked for (`-m compile`) or when its file is named; the bare command runs the rest, the fast lane. CI runs
# every lane (.ci/run). tests/test_lanes.py checks that each test is in exactly one lane.
LANES = ("compile", "distributed", "slow")
#: the pytest-xdist workers CI gives each lane (`-n`): the compile and slow lanes spend most of their time in one
#: Python thread (dynamo's tracing, subprocess CLI runs), so two workers use a 2-core machine's second core; the
#: distributed lane starts its own worker processes and binds ports, and runs alone (0: no xdist)
LANE_WORKERS = {"compile": 2, "distributed": 0, "slow": 2}
FAST_LANE = " and ".join(f"not {lane}" for lane in LANES)
_fast_lane = pytest.StashKey[bool]()


def pytest_configure(config):
    """`python -m pytest` with no path and no `-m` runs the fast lane. A named path or node id, or any `-m`,
    runs what it names in every lane: a contributor naming a compile test file gets its tests, not none."""
    bare = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr
    config.stash[_fast_lane] = bare
    if bare:
        config.option.markexpr = FAST_LANE


def pytest_report_header(config):
    """Say which lane runs, in the header pytest prints without `-q`."""
    if config.stash.get(_fast_lane, False):
        return f"lanes: the fast lane (-m '{FAST_LANE}'); CI also runs " + ", ".join(f"-m {x}" for x in LANES)
    return None


def pytest_terminal_summary(terminalreporter, config):
    """Under `-q` too: the bare command's deselected tests are the other lanes, not lost ones."""
    if config.stash.get(_fast_lane, False) and terminalreporter.stats.get("deselected"):
        n = len(terminalreporter.stats["deselected"])
        terminalreporter.write_line(
            f"fast lane: {n} tests of the lanes {', '.join(LANES)} not run; CI runs them "
            f"(python -m pytest -q -m {LANES[0]}, ...; python -m pytest -q tests runs every lane)"
        )


@pytest.fixture
def device_path():
    """Steps on the CPU take the device path of the non-finite skip (what a GPU runs), which they
    otherwise read back on the host (`modopt.core.runner.device_path`)."""
    from modopt.core import runner

    with runner.device_path():
        yield
