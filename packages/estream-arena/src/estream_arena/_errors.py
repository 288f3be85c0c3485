"""Exception classes of the arena, the residency protocol and the loader.

Every read failure names the layer, the group and the byte offset in the file so that a user can
find the damaged extent (``dd skip=... count=...``) without reading our code.
"""

from __future__ import annotations

__all__ = [
    "ArenaError",
    "ChecksumError",
    "FileChangedError",
    "LoaderClosedError",
    "ProtocolError",
    "ReadError",
    "ShortReadError",
]


class ArenaError(Exception):
    """Base class of every error raised by estream-arena."""


class ProtocolError(ArenaError):
    """An illegal transition of the residency protocol (a caller bug, never an I/O problem)."""


class LoaderClosedError(ArenaError):
    """The loader (or its arena) was closed while, or before, the call was made."""


def _restore(cls: type[BaseException], args: tuple[object, ...], state: dict[str, object]):
    obj = cls.__new__(cls)
    BaseException.__init__(obj, *args)
    obj.__dict__.update(state)
    return obj


class ReadError(ArenaError):
    """Reading a group's extent failed; ``layer``, ``group``, ``offset`` say which extent.

    Raised as is for an ``OSError`` from the read (``errno`` is kept, the ``OSError`` is the
    ``__cause__``); the subclasses below name the more specific failures.
    """

    def __init__(
        self,
        message: str,
        *,
        layer: int,
        group: int,
        offset: int,
        nbytes: int,
        path: str = "",
        errno: int | None = None,
    ) -> None:
        where = f"layer {layer}, group {group}, file offset {offset} (+{nbytes} bytes)"
        if path:
            where += f" of {path}"
        super().__init__(f"{where}: {message}")
        self.layer = layer
        self.group = group
        self.offset = offset
        self.nbytes = nbytes
        self.path = path
        self.errno = errno

    def __reduce__(self):  # keyword-only __init__: pickle/copy through the instance dict
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class ShortReadError(ReadError):
    """The file ended before the group's extent did (the file is shorter than the request)."""


class FileChangedError(ReadError):
    """The file was truncated, extended, rewritten or replaced after the loader opened it."""


class ChecksumError(ReadError):
    """A record's ``zlib.crc32`` differs from the expected one (``verify=True``)."""

    def __init__(
        self,
        message: str,
        *,
        record: int,
        expected: int,
        actual: int,
        **kwargs: object,
    ) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.record = record
        self.expected = expected
        self.actual = actual
