"""The one writer of every file a command writes (``prefill --all-logits/--trace``,
``eval --output/--details``, ``config --plot``, the task commands' ``--output``). The one
exception is a task command's Parquet output with ``--ray``: a directory of part files that
Ray Data's writer makes (`estream_cli.ray_commands`: a new directory, renamed into place).

* ``-`` is standard output: the bytes go there directly.
* A new path, or an existing regular file, is written under a temporary name in the same
  directory (``.NAME.XXXXXXXX.tmp``), flushed to disk and renamed onto the path: a reader sees
  the old file or the whole new one, never a part; on any error the temporary file is removed
  and the path is left as it was. A replaced file keeps its permission bits; a new one gets
  ``0666`` less the umask.
* Anything else at the path is refused before anything is written, with one error line: a
  directory, a character or block device (``/dev/null``), a FIFO, a socket. Renaming onto
  those would replace the node itself (as root, ``/dev/null`` would become a regular file).
* A symbolic link is followed: when it ends at a regular file (or at a new name in an existing
  directory) that file is written as above, in its own directory, and the link stays a link;
  a link to anything else (``/dev/null``), a dangling link into a missing directory, or a loop
  is refused.

The check runs twice: once up front (`check_output`, so a command can refuse a bad path before
it loads a model), and again just before the rename. A new file is put in place with
``link()``, which fails rather than replace something that appeared at the path meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from estream.errors import BadRequestError

__all__ = [
    "STDOUT",
    "check_output",
    "stdout_claimed",
    "write_json",
    "write_output",
    "write_output_named",
]

#: The path that means standard output.
STDOUT = "-"

_NODE_KINDS: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _NODE_KINDS if test(mode)), "not a regular file")


def _refuse(option: str, path: str, message: str) -> BadRequestError:
    return BadRequestError(f"{option} {path}: {message}")


def _target(path: str, option: str) -> tuple[Path, os.stat_result | None]:
    """The file that writing `path` replaces (the end of a symbolic link) and its status now
    (None: nothing there yet); BadRequestError when it must not be written."""
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise _refuse(option, path, "ends in a slash, so it names a directory; give a file path")
    p = Path(path)
    target = p
    if p.is_symlink():
        try:
            target = p.resolve(strict=False)
            if target.is_symlink() or not target.parent.is_dir():
                raise OSError
        except (OSError, RuntimeError):  # a loop (RuntimeError before Python 3.13), a dangle
            raise _refuse(
                option, path, "a symbolic link that ends nowhere writable; refusing to follow it"
            ) from None
    try:
        st: os.stat_result | None = target.lstat()
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _refuse(option, path, f"cannot write ({exc.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        via = f" (through the link to {target})" if target != p else ""
        raise _refuse(
            option,
            path,
            f"is {_kind(st.st_mode)}{via}, not a regular file; refusing to replace it "
            "(give a file path, or - for standard output)",
        )
    if st is None and not target.parent.is_dir():
        raise _refuse(option, path, f"directory {target.parent} does not exist")
    return target, st


def check_output(path: str | None, option: str) -> None:
    """Raise BadRequestError now if `path` could not be written by `write_output` (a directory,
    a device, a FIFO, a socket, a missing directory); None and ``-`` pass."""
    if path is not None and path != STDOUT:
        _target(path, option)


def stdout_claimed(outputs: Iterable[tuple[str, str | None]]) -> bool:
    """Whether one of the (option, path) outputs is ``-``; BadRequestError if two are."""
    dashes = [option for option, path in outputs if path == STDOUT]
    if len(dashes) > 1:
        raise BadRequestError(f"only one output can be - (standard output): {', '.join(dashes)}")
    return bool(dashes)


def _to_stdout(write: Callable[[BinaryIO], object]) -> None:
    sys.stdout.flush()
    raw = getattr(sys.stdout, "buffer", None)
    if raw is None:  # a text-only stream stands in for stdout
        buf = io.BytesIO()
        write(buf)
        sys.stdout.write(buf.getvalue().decode("utf-8", "surrogateescape"))
        sys.stdout.flush()
        return
    write(raw)
    raw.flush()


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system can sync a directory
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _put_in_place(tmp: Path, target: Path, before: os.stat_result | None, where: str) -> None:
    appeared = f"{where}: something appeared there while it was being written; left it alone"
    if before is None:
        try:
            os.link(tmp, target)  # never replaces: fails if something appeared meanwhile
            return
        except FileExistsError:
            raise BadRequestError(appeared) from None
        except OSError:  # a file system without hard links: look again, then rename
            if os.path.lexists(target):
                raise BadRequestError(appeared) from None
    else:
        now = os.lstat(target)
        if not stat.S_ISREG(now.st_mode) or (now.st_ino, now.st_dev) != (
            before.st_ino,
            before.st_dev,
        ):
            raise BadRequestError(f"{where}: it was replaced while being written; left it alone")
    os.replace(tmp, target)


def write_output(path: str, option: str, write: Callable[[BinaryIO], object]) -> None:
    """Write the bytes `write(f)` produces to `path` as the module docstring says: ``-`` is
    standard output, a regular file or a new path is replaced atomically, anything else is
    refused. Errors are BadRequestError naming `option` and `path`; exceptions from `write`
    other than OSError propagate, after the temporary file is removed."""
    if path == STDOUT:
        _to_stdout(write)
        return
    target, before = _target(path, option)
    where = f"{option} {path}"
    # the name first, the file made under it inside the `try` that removes it: an interrupt at
    # any moment leaves nothing behind
    tmp: Path | None = target.with_name(
        f".{target.name[:200]}.{secrets.token_hex(6)}.tmp{target.suffix}"
    )
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            tmp = None  # not made here: nothing to remove
            raise BadRequestError(f"{where}: cannot write ({exc.strerror})") from None
        with os.fdopen(fd, "wb") as f:
            if before is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(before.st_mode))
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _put_in_place(tmp, target, before, where)
        _fsync_dir(target.parent)
    except OSError as exc:
        raise BadRequestError(f"{where}: cannot write ({exc.strerror or exc})") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def write_output_named(path: str, option: str, write_to: Callable[[Path], object]) -> None:
    """`write_output` for writers that need a file name (matplotlib's ``savefig``): `write_to`
    gets a scratch file whose name ends as `path` does, and its bytes go through
    `write_output`."""
    with tempfile.TemporaryDirectory(prefix="estream-out-") as scratch:
        name = Path(scratch) / f"out{Path(path).suffix if path != STDOUT else ''}"
        write_to(name)
        with name.open("rb") as src:
            write_output(path, option, lambda f: shutil.copyfileobj(src, f))


def write_json(path: str, option: str, doc: Any, *, lines: bool = False) -> None:
    """JSON through `write_output`: one indented document, or with `lines` one compact object
    per line (JSON Lines)."""

    def write(f: BinaryIO) -> None:
        if lines:
            for obj in doc:
                f.write((json.dumps(obj) + "\n").encode())
        else:
            f.write((json.dumps(doc, indent=1) + "\n").encode())

    write_output(path, option, write)
