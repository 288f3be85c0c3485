"""The model's own chat template (``tokenizer.chat_template``), rendered with jinja2.

Instruction-tuned models answer best when the prompt looks like a chat turn. The GGUF carries
the Jinja template the model was trained with; we render it in a *sandboxed* environment (the
template comes from a downloaded file) as Hugging Face ``apply_chat_template`` does:
``messages=[{"role": "user", "content": text}]``, ``add_generation_prompt=True`` and the
``bos_token``/``eos_token`` strings of the vocabulary.

The sandbox keeps a template from Python's internals but not from asking for too much: a
rendering is bounded in size (`MAX_RENDER_CHARS`, or four times the message when that is more)
and in time (`MAX_RENDER_SECONDS`). Every string or list a template builds by repetition,
concatenation, a filter or a method call is checked against the size bound before it is built,
and the time bound is checked at each of those steps and each piece of output; on the main
thread a timer also ends a loop that does none of them.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from .errors import BadRequestError

__all__ = [
    "CHAT_TEMPLATE_KEY",
    "MAX_RENDER_CHARS",
    "MAX_RENDER_SECONDS",
    "ChatTemplate",
    "NoChatTemplateError",
    "TemplateRenderError",
]

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

#: The most characters a rendering (and any string or list built on the way) may hold, unless
#: four times the message is more.
MAX_RENDER_CHARS = 1 << 20

#: The most time one rendering may take.
MAX_RENDER_SECONDS = 2.0


class NoChatTemplateError(BadRequestError):
    """``--template`` was asked for but the model has no ``tokenizer.chat_template``."""


class TemplateRenderError(BadRequestError):
    """The chat template failed to compile or render (or called ``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise TemplateRenderError(f"the model's chat template refused the prompt: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _Bounds(threading.local):
    """The size and time bounds of the rendering running on this thread (none outside one)."""

    limit: int = MAX_RENDER_CHARS
    deadline: float = math.inf


_BOUNDS = _Bounds()


def _too_big(what: str) -> TemplateRenderError:
    return TemplateRenderError(
        f"the model's chat template builds {what} beyond {_BOUNDS.limit:,} characters; "
        "refusing to render it"
    )


def _check_time() -> None:
    if time.monotonic() > _BOUNDS.deadline:
        raise TemplateRenderError(
            f"the model's chat template takes longer than {MAX_RENDER_SECONDS:g} s to render; "
            "refusing it"
        )


def _check_args(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """A width or count argument beyond the size bound would build a string that large."""
    _check_time()
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _BOUNDS.limit:
            raise _too_big(f"something from the number {v}")


def _check_result(v: Any) -> Any:
    if isinstance(v, str | list | tuple | dict) and len(v) > _BOUNDS.limit:
        raise _too_big("a value")
    return v


def _check_format(spec: Any) -> None:
    """A printf or str.format pattern whose field width or precision is beyond the size
    bound (``'%9999999999d'``) would build a string that large."""
    if isinstance(spec, str):
        for digits in re.findall(r"[0-9]{7,}", spec):
            if int(digits) > _BOUNDS.limit:
                raise _too_big(f"a formatted field {int(digits)} wide")


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps jinja2's pass_context/pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        _check_args(args[1:], kwargs)
        if name == "format":
            for a in args:
                _check_format(a)
        return _check_result(f(*args, **kwargs))

    return run


def _bounded_join(parts: tuple[Any, ...]) -> str:
    """The ``~`` operator's join (jinja2's ``str_join``), within the size bound."""
    _check_time()
    strs = [str(p) for p in parts]
    if sum(map(len, strs)) > _BOUNDS.limit:
        raise _too_big("a concatenation")
    return "".join(strs)


def _environment() -> Any:
    """The sandboxed environment with the size and time bounds."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):  # type: ignore[misc]
        def visit_Concat(self, node: Any, frame: Any) -> None:
            # ``a ~ b`` through the bounded join (the environment autoescapes nothing).
            self.write("environment.bounded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):  # type: ignore[misc]
        code_generator_class = Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        bounded_join = staticmethod(_bounded_join)

        def call(self, context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
            _check_args(args, kwargs)
            return _check_result(super().call(context, obj, *args, **kwargs))

        def wrap_str_format(self, value: Any) -> Any:
            # ``'{:>N}'.format(...)``: the pattern is checked when the method is looked up
            if getattr(value, "__name__", None) in ("format", "format_map"):
                _check_format(getattr(value, "__self__", None))
            return super().wrap_str_format(value)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_time()
            seq = (str, list, tuple)
            if operator == "%":
                _check_format(left)
            elif operator == "*":
                for a, n in ((left, right), (right, left)):
                    if isinstance(a, seq) and isinstance(n, int) and len(a) * n > _BOUNDS.limit:
                        raise _too_big("a repeated value")
            elif operator == "+" and isinstance(left, seq) and isinstance(right, seq):
                if len(left) + len(right) > _BOUNDS.limit:
                    raise _too_big("a concatenation")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                big = abs(left) > 1 and right * math.log2(abs(left)) > 4096
                if big:
                    raise _too_big(f"a number ({left} ** {right})")
            return super().call_binop(context, operator, left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.filters = {k: _bounded_filter(k, f) for k, f in env.filters.items()}
    return env


@attrs.frozen
class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    source: str = attrs.field(repr=lambda s: f"<{len(s)} chars>")
    bos_token: str = ""
    eos_token: str = ""
    _compiled: Any = attrs.field(default=None, eq=False, repr=False, alias="compiled")

    @classmethod
    def from_kv(
        cls,
        kv: Mapping[str, Any],
        *,
        bos_token: str = "",
        eos_token: str = "",
        where: str = "the model",
    ) -> ChatTemplate:
        """The template stored under ``tokenizer.chat_template`` in GGUF metadata ``kv``."""
        src = kv.get(CHAT_TEMPLATE_KEY)
        if isinstance(src, bytes):
            src = src.decode("utf-8", "replace")
        if not isinstance(src, str) or not src.strip():
            raise NoChatTemplateError(
                f"{where} has no chat template (GGUF key {CHAT_TEMPLATE_KEY!r}); "
                "drop --template and write the prompt in the model's format yourself"
            )
        return cls.compile(src, bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def from_gguf(
        cls, path: str | Path, *, bos_token: str = "", eos_token: str = ""
    ) -> ChatTemplate:
        """Read the template of a GGUF file or of a packed model directory."""
        from .packed import read_gguf_kv
        from .tokenizer._gguf import resolve_gguf_path

        gguf = resolve_gguf_path(path)
        return cls.from_kv(
            read_gguf_kv(gguf), bos_token=bos_token, eos_token=eos_token, where=str(path)
        )

    @classmethod
    def compile(cls, source: str, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """Compile ``source`` in a sandbox (no attribute access to Python internals)."""
        import jinja2

        env = _environment()
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(source)
        except (jinja2.TemplateError, RecursionError, MemoryError) as exc:
            raise TemplateRenderError(
                f"the model's chat template does not compile: {exc or 'too deeply nested'}"
            ) from None
        return cls(source, bos_token, eos_token, compiled=compiled)

    def render(self, content: str, *, add_generation_prompt: bool = True) -> str:
        """The text of one user turn ``content`` (followed by the assistant prompt), within the
        size and time bounds (see the module's docstring)."""
        import jinja2

        limit = max(MAX_RENDER_CHARS, 4 * len(content))
        _BOUNDS.limit, _BOUNDS.deadline = limit, time.monotonic() + MAX_RENDER_SECONDS
        try:
            with _alarm(MAX_RENDER_SECONDS):
                parts = self._compiled.generate(
                    messages=[{"role": "user", "content": content}],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                )
                return "".join(_bounded_output(parts, limit))
        except TemplateRenderError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, OverflowError) as exc:
            raise TemplateRenderError(
                f"the model's chat template failed to render: {exc}"
            ) from None
        except (RecursionError, MemoryError):
            raise TemplateRenderError(
                "the model's chat template failed to render: it recurses too deeply or "
                "needs too much memory"
            ) from None
        finally:
            _BOUNDS.limit, _BOUNDS.deadline = MAX_RENDER_CHARS, math.inf

    def split(self, content_before: str, content_after: str) -> tuple[str, str]:
        """Render a user turn whose content is ``content_before + X + content_after`` and return
        the text before and after ``X`` — how a varying middle part (a document) is placed in
        the turn while the rest is rendered once."""
        marker = "\x00ESTREAM-SPLIT\x00"
        text = self.render(content_before + marker + content_after)
        if text.count(marker) != 1:
            raise TemplateRenderError(
                "the model's chat template rewrites the message content; cannot place a "
                "document inside it"
            )
        before, after = text.split(marker)
        return before, after


def _bounded_output(parts: Iterator[str], limit: int) -> Iterator[str]:
    n = 0
    for part in parts:
        n += len(part)
        if n > limit:
            raise _too_big("an output")
        _check_time()
        yield part


class _alarm:
    """On the main thread, a timer that ends the rendering after ``seconds`` even inside a
    loop that calls nothing the bounds check (elsewhere, those checks alone)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = False
        self.old: Any = None

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
            return  # somebody else's timer is running: leave it alone

        def expire(signum: int, frame: object) -> None:
            _check_time()  # raises once the deadline has passed
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # woken early: look again soon

        self.old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        self.armed = True

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
            self.armed = False
