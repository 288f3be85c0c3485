"""The model's own chat template (``tokenizer.chat_template``), rendered with jinja2.

Instruction-tuned models answer best when the prompt looks like a chat turn. The GGUF carries
the Jinja template the model was trained with; we render it in a *sandboxed* environment (the
template comes from a downloaded file) as Hugging Face ``apply_chat_template`` does:
``messages=[{"role": "user", "content": text}]``, ``add_generation_prompt=True`` and the
``bos_token``/``eos_token`` strings of the vocabulary.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .errors import BadRequestError

__all__ = ["CHAT_TEMPLATE_KEY", "ChatTemplate", "NoChatTemplateError", "TemplateRenderError"]

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


class NoChatTemplateError(BadRequestError):
    """``--template`` was asked for but the model has no ``tokenizer.chat_template``."""


class TemplateRenderError(BadRequestError):
    """The chat template failed to compile or render (or called ``raise_exception``)."""


def _raise_exception(message: str) -> None:
    raise TemplateRenderError(f"the model's chat template refused the prompt: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


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
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(
                f"the model's chat template does not compile: {exc}"
            ) from None
        return cls(source, bos_token, eos_token, compiled=compiled)

    def render(self, content: str, *, add_generation_prompt: bool = True) -> str:
        """The text of one user turn ``content`` (followed by the assistant prompt)."""
        import jinja2

        try:
            return str(
                self._compiled.render(
                    messages=[{"role": "user", "content": content}],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                )
            )
        except TemplateRenderError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise TemplateRenderError(
                f"the model's chat template failed to render: {exc}"
            ) from None

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
