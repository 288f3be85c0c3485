"""What the command prints about a failure or a count: plain sentences, no Python in them.

An error of any EStream package (a class defined in one of them) carries a message written for
the user; the command prints that message alone (never the exception's class name). An error
nobody anticipated is a bug: it is said to be one, with the way to see where it happened.
"""

from __future__ import annotations

__all__ = ["describe", "is_anticipated", "plural"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 pass``, ``2 passes``, ``0 prompt tokens``: ``n`` and the right form of ``word``
    (``many``: the plural when adding -s/-es is wrong)."""
    if n == 1:
        return f"{n} {word}"
    if many is None:
        many = word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n} {many}"


#: The packages whose errors carry messages written for the user.
_OWN_PACKAGES = frozenset(
    {"estream", "estream_cli", "estream_layout", "estream_arena", "estream_sched", "estream_htp"}
)


def _own(exc: BaseException) -> bool:
    """Is ``exc`` (or a class it derives from) an error class of an EStream package?"""
    return any(
        (cls.__module__ or "").split(".")[0] in _OWN_PACKAGES
        for cls in type(exc).__mro__
        if cls not in (BaseException, Exception)
    )


def is_anticipated(exc: BaseException) -> bool:
    """Is ``exc`` an error with a message for the user (not a bug)?"""
    return _own(exc) or isinstance(exc, OSError | MemoryError | RecursionError)


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, without the exception's class name."""
    if isinstance(exc, OSError) and not _own(exc):
        what = exc.strerror or str(exc) or "input/output error"
        name = exc.filename
        return f"{name}: {what[:1].lower()}{what[1:]}" if name else what
    if isinstance(exc, MemoryError):
        return "out of memory"
    if isinstance(exc, RecursionError):
        return "the input is nested too deeply"
    text = " ".join(str(exc).split()) or "no details"
    if is_anticipated(exc):
        return text
    return f"internal error, please report it (ESTREAM_DEBUG=1 shows where it happened): {text}"
