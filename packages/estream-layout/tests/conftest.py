from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny synthetic GGUF per architecture (generated once per test session), with Q4_0
    experts whatever the family's default (gpt-oss's is MXFP4): the tests read their tiles by
    Q4_0's layout."""
    from estream_layout import ARCHES, synth_model

    d = tmp_path_factory.mktemp("tiny")
    return {
        arch: synth_model(arch, "tiny", d / f"{arch}.gguf", seed=3, expert_type="Q4_0")
        for arch in ARCHES
    }
