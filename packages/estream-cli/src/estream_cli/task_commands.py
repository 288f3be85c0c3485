"""Task commands (classify, score, rerank, embed): registered into the `estream` parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["add_task_commands"]


def add_task_commands(sub: Any, add_engine_opts: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the prefill-only task sub-commands to `sub` (an argparse subparsers object)."""
    return None
