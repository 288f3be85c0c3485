"""Console scripts `estream-pack` and `estream-synth`.

Errors a user can cause (bad paths, non-GGUF input, existing targets, ...) end with one line on
stderr and exit status 2 (1 when a verification finds problems); never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import _sigint
from .errors import LayoutError
from .synth import ARCHES, PRESET_ARCH, PRESETS

__all__ = ["pack_main", "synth_main"]

EXIT_PROBLEMS = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
# GGML types estream-synth writes (random valid blocks; F16/BF16/F32 as values)
SYNTH_TYPES = [
    "Q4_0",
    "Q8_0",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
    "IQ4_NL",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "IQ4_XS",
    "F16",
    "BF16",
    "F32",
]


def _fail(prog: str, msg: str) -> int:
    sys.stderr.write(f"{prog}: error: {msg}\n")
    return EXIT_ERROR


def _identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) of what is at ``path`` now, None when nothing is: a pack placed by
    this command is a new directory there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while packing (main thread only), so the temporary
    directory is removed instead of being left behind by a default-action termination."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def pack_main(argv: Sequence[str] | None = None) -> int:
    """`estream-pack SRC.gguf -o NAME.estream | --verify DIR [--against SRC] | --inspect DIR`."""
    ap = argparse.ArgumentParser(
        prog="estream-pack",
        description="Pack a GGUF MoE model into EStream's streamable layout, or verify/inspect a pack.",
    )
    ap.add_argument("src", nargs="?", help="source GGUF model")
    ap.add_argument("-o", "--output", help="output directory, conventionally NAME.estream")
    ap.add_argument("--force", action="store_true", help="replace an existing output directory")
    ap.add_argument("--order-profile", metavar="JSON", help="routing profile: hot experts first")
    ap.add_argument(
        "--requantize",
        choices=["q4_0"],
        help="re-quantize expert tensors of a type EStream does not compute (anything but "
        "Q4_0, Q8_0, Q4_K, Q6_K) to Q4_0 instead of refusing the file (less accurate)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--verify", metavar="DIR", help="verify a packed model")
    ap.add_argument("--against", metavar="SRC", help="with --verify: compare with the source GGUF")
    ap.add_argument("--inspect", metavar="DIR", help="summarise a packed model")
    ap.add_argument("--json", action="store_true", help="with --inspect/--verify: print JSON")
    args = ap.parse_args(argv)
    try:
        _sigint.restore()  # from here a Ctrl-C is a KeyboardInterrupt, caught below
        if args.verify:
            from .verify import verify_pack

            report = verify_pack(args.verify, against=args.against)
            if args.json:
                print(json.dumps(report.to_dict(), indent=1))
            else:
                what = " and against the source" if report.compared_with_source else ""
                print(
                    f"{report.path}: {report.checked_records} records "
                    f"({report.checked_bytes / 2**20:,.1f} MiB) checked{what}: "
                    + (
                        "OK"
                        if report.ok
                        else (
                            f"{len(report.problems)} problem"
                            + ("" if len(report.problems) == 1 else "s")
                        )
                    )
                )
                for p in report.problems:
                    print(f"  - {p}")
            return 0 if report.ok else EXIT_PROBLEMS
        if args.inspect:
            from .verify import format_inspect, inspect_pack

            info = inspect_pack(args.inspect)
            print(json.dumps(info, indent=1) if args.json else format_inspect(info))
            return 0
        if not args.src or not args.output:
            return _fail(
                "estream-pack", "give SRC.gguf -o NAME.estream (or --verify/--inspect DIR)"
            )
        from .pack import pack_model

        before = _identity(args.output)
        try:
            with _terminate_as_interrupt():  # `kill` cleans up the temporary pack like Ctrl-C
                m = pack_model(
                    args.src,
                    args.output,
                    order=args.order_profile,
                    force=args.force,
                    progress=not args.no_progress,
                    requantize=args.requantize,
                )
            _sigint.ignore()  # the pack is in place: a Ctrl-C now would only cut the last line
        except KeyboardInterrupt:
            _sigint.ignore()
            placed = _identity(args.output)
            if placed is None or placed == before:
                raise
            # The signal came after the finished pack was renamed into place (while its
            # manifest was read back): it is written, so say so rather than "nothing was".
            print(f"packed {args.src} -> {os.path.abspath(args.output)} (then interrupted)")
            return 0
        print(
            f"packed {args.src} -> {m.root} ({len(m.layers)} MoE layers, "
            f"{m.experts_bytes / 2**20:,.1f} MiB of experts)"
        )
        return 0
    except LayoutError as e:
        return _fail("estream-pack", str(e))
    except KeyboardInterrupt:
        _fail("estream-pack", "interrupted; nothing was written")
        return EXIT_INTERRUPTED
    except OSError as e:
        return _fail("estream-pack", f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))


def _ascii_int(text: str) -> int:
    """argparse type of an integer option: ASCII digits with an optional '-' (``int()`` alone
    also takes '１', '٣' or '1_000')."""
    if not re.fullmatch(r"-?[0-9]{1,30}", text.strip()):
        raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits), got {text!r}")
    return int(text)


def _dims(items: Sequence[str]) -> dict[str, int] | str:
    """``--dim NAME=N`` items as a mapping, or the first item not of that form."""
    dims: dict[str, int] = {}
    for item in items:
        name, _, value = item.partition("=")
        if not re.fullmatch(r"[0-9]{1,30}", value.strip()):
            return item
        dims[name.strip()] = int(value)
    return dims


def synth_main(argv: Sequence[str] | None = None) -> int:
    """`estream-synth --arch A --preset P [--seed N] [--vocab VOCAB.gguf] -o model.gguf`."""
    # long: the command's option table (ten options), then one call and its error mapping
    ap = argparse.ArgumentParser(
        prog="estream-synth",
        description="Write a synthetic GGUF MoE model that llama.cpp can load.",
    )
    ap.add_argument("--arch", required=True, choices=ARCHES, help="model family to imitate")
    ap.add_argument(
        "--preset", required=True, choices=PRESETS, help="size and shape (tiny: for tests)"
    )
    ap.add_argument(
        "--seed", type=_ascii_int, default=0, help="seed of the random weights (default 0)"
    )
    ap.add_argument(
        "--vocab",
        help="GGUF to copy tokenizer.ggml.* from (default: by family; '-': a generated one)",
    )
    ap.add_argument("-o", "--output", required=True, help="output .gguf path")
    ap.add_argument("--force", action="store_true", help="replace an existing output file")
    ap.add_argument(
        "--expert-type",
        choices=SYNTH_TYPES,
        help="GGML type of the routed experts (default: the family's, Q4_0; MXFP4 for gpt-oss, "
        "as published; K-quants need d_model and the expert width multiples of 256, e.g. "
        "--dim n_embd=256 --dim n_ff_exp=256)",
    )
    ap.add_argument(
        "--expert-down-type",
        choices=SYNTH_TYPES,
        help="another type for ffn_down_exps (Q4_K_M's mix: --expert-type Q4_K "
        "--expert-down-type Q6_K)",
    )
    ap.add_argument(
        "--dense-type",
        default="Q4_0",
        choices=SYNTH_TYPES,
        help="GGML type of the dense matrices and the embedding (default Q4_0)",
    )
    ap.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=N",
        help="override one preset dimension (e.g. n_embd=256); repeatable",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress line")
    args = ap.parse_args(argv)
    dims = _dims(args.dim)
    if isinstance(dims, str):
        return _fail("estream-synth", f"--dim {dims!r}: expected NAME=N with N an integer")
    if PRESET_ARCH.get(args.preset, args.arch) != args.arch:
        return _fail(
            "estream-synth",
            f"preset {args.preset} is the shape of a {PRESET_ARCH[args.preset]} model; "
            f"use --arch {PRESET_ARCH[args.preset]}",
        )
    out = Path(args.output)
    if out.is_dir() or args.output.endswith(("/", os.sep)):
        return _fail("estream-synth", f"-o {args.output}: is a directory; give a file path")
    if (out.exists() or out.is_symlink()) and not args.force:
        return _fail(
            "estream-synth", f"-o {args.output}: already exists; add --force to replace it"
        )
    from .synth import synth_model

    before = _identity(args.output)
    try:
        _sigint.restore()  # from here a Ctrl-C is a KeyboardInterrupt, caught below
        path = synth_model(
            args.arch,
            args.preset,
            args.output,
            seed=args.seed,
            vocab=args.vocab,
            expert_type=args.expert_type,
            expert_down_type=args.expert_down_type,
            dense_type=args.dense_type,
            dims=dims,
            progress=not args.no_progress,
        )
        _sigint.ignore()  # the file is in place: a Ctrl-C now would only cut the last line
    except LayoutError as e:
        return _fail("estream-synth", str(e))
    except (ValueError, TypeError) as e:  # blocks not dividing the widths; an unknown --dim
        return _fail("estream-synth", str(e))
    except OSError as e:
        return _fail("estream-synth", f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
    except KeyboardInterrupt:
        _sigint.ignore()
        placed = _identity(args.output)
        if placed is None or placed == before:
            _fail("estream-synth", "interrupted")
            return EXIT_INTERRUPTED
        # the signal came after the finished file was renamed into place: it is written
        path = Path(args.output)
    print(f"wrote {path} ({path.stat().st_size / 2**20:,.1f} MiB)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pack_main())
