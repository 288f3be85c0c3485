"""The README's embedding examples run as written; the first fits one screen."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs() -> None:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    assert len(blocks[0].strip().splitlines()) <= 15, "the first example is longer than 15 lines"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for code in blocks:
            exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    # 3 planes x B=3 banks x G=4 slots of 8192 + 8192 + 4096 bytes
    assert out.getvalue().strip() == f"arena holds {3 * 4 * (8192 + 8192 + 4096)} bytes"
