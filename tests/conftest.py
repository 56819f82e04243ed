import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import tra_sql

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE: ``ci`` (the default; tests scale their example
# counts from its max_examples of 100, see test_differential.examples) and ``long`` (fuzzing for an
# hour: ``HYPOTHESIS_PROFILE=long python -m pytest -m fuzz``; fuzz tests then have no timeout; its
# example count, 20,000, can be set with TRA_SQL_FUZZ_EXAMPLES).
settings.register_profile("ci", max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=int(os.environ.get("TRA_SQL_FUZZ_EXAMPLES", 20_000)), deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(items):
    if PROFILE == "long":
        for item in items:
            if item.get_closest_marker("fuzz"):
                item.add_marker(pytest.mark.timeout(0))


def pytest_terminal_summary(terminalreporter):
    """How many random programs the differential tests ran, and paths they compared."""
    diffgen = sys.modules.get("diffgen")
    if diffgen is not None and diffgen.COUNTS:
        counts = ", ".join(f"{n} {what}" for what, n in sorted(diffgen.COUNTS.items()))
        terminalreporter.write_line(f"differential ({PROFILE} profile): {counts}")


@pytest.fixture
def db():
    session = tra_sql.connect()
    yield session
    session.close()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _session_on(kernels: str):
    """A two-thread session on ``kernels`` (``native`` or ``arrow``, as ``TRA_SQL_KERNELS``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRA_SQL_KERNELS", kernels)
        session = tra_sql.connect(threads=2)
    assert session.engine.kernels == kernels
    return session


@pytest.fixture(scope="module")
def native():
    """A session on the native kernels, shared by a module's tests."""
    session = _session_on("native")
    yield session
    session.close()


@pytest.fixture(scope="module")
def arrow():
    """A session on the Arrow UDFs, shared by a module's tests."""
    session = _session_on("arrow")
    yield session
    session.close()
