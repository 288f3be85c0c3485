"""The `estream` command: argument parsing, printing and output files over the `estream` library.

`estream_cli` imports `estream`, never the reverse; embedding the engine (`import estream`) loads
none of these modules.
"""

from __future__ import annotations

__version__ = "0.1.0"
