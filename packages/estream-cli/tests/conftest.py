"""Shared pytest configuration for estream-cli: Hypothesis profiles, and a profiled tiny pack.

``HYPOTHESIS_PROFILE=ci`` (the default, what nox sets) keeps runs short and reproducible;
``HYPOTHESIS_PROFILE=dev`` explores more examples.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny OLMoE pack with a real (small) profile stored, calibrated at 1 thread on 8 tokens
    (candidates 1 and 2, queue depths 1 and 2). Shared: a test that changes it copies it."""
    from estream.config import store_profile
    from estream.packed import PackedModel
    from estream.profiling import profile_model
    from estream_layout import pack_model, synth_model

    d = tmp_path_factory.mktemp("profiled")
    synth_model("olmoe", "tiny", d / "m.gguf", seed=5)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    prof = profile_model(
        d / "m.estream",
        candidates=(1, 2),
        queue_depths=(1, 2),
        n_tokens=8,
        bw_rounds=1,
        n_threads=1,
    )
    store_profile(PackedModel(d / "m.estream"), prof)
    return d / "m.estream"
