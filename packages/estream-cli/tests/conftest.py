"""Shared pytest configuration for estream-cli: Hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (the default, what nox sets) keeps runs short and reproducible;
``HYPOTHESIS_PROFILE=dev`` explores more examples.
"""

from __future__ import annotations

import os

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
