from __future__ import annotations

import os
import threading

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=600,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("estream-arena-loader")]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every test must leave no loader thread behind, whatever happened inside it."""
    yield
    assert loader_threads() == [], f"loader threads left running: {loader_threads()}"


@pytest.fixture
def workdir(tmp_path_factory):
    """A directory on a real disk when possible (O_DIRECT), tmp otherwise."""
    return tmp_path_factory.mktemp("arena")
