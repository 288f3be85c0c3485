"""Pre-tokenizers: split text into words before byte-level BPE, exactly as llama.cpp does.

Each pre-tokenizer is a list of regexes applied in turn: the first splits the text into its
matches *and* the unmatched stretches between them; every later regex splits each of those
pieces the same way. Regexes that use Unicode categories (``\\p{L}``...) run on the collapsed
text (see :mod:`._unicode`) with the categories rewritten into classes of the collapse
characters, the others on the text with non-ASCII whitespace turned into ``\\v``. Both are
matched with ASCII semantics for ``\\s`` (llama.cpp uses ``std::regex`` in the C locale), so
the splits match llama.cpp's byte for byte. llama.cpp's hand-written splitters for the GPT-2
and Llama-3 regexes implement those same regexes, so one mechanism covers them all.
"""

from __future__ import annotations

import re

import attrs

from . import _unicode as u
from ._errors import UnsupportedTokenizerError

__all__ = ["PreTokenizer", "pre_tokenizer_for", "supported_pre_tokenizers"]

# What each category becomes inside a character class of a collapsed regex: its collapse
# character plus the ASCII members llama.cpp lists for it (ASCII is not collapsed).
_CATEGORY_CLASS = {
    "N": u.COLLAPSED_NUMBER + "0-9",
    "L": u.COLLAPSED_LETTER + "A-Za-z",
    "Lu": u.COLLAPSED_LETTER + "A-Za-z",
    "Ll": u.COLLAPSED_LETTER + "A-Za-z",
    "Lt": u.COLLAPSED_LETTER + "A-Za-z",
    "Lm": u.COLLAPSED_LETTER + "A-Za-z",
    "Lo": u.COLLAPSED_LETTER + "A-Za-z",
    "P": u.COLLAPSED_PUNCT + "!-#%-*,-/:;?@\\[-\\]_{}",
    "M": u.COLLAPSED_MARK,
    # '~' as in llama.cpp of llama-cpp-python 0.3.36 (some llama.cpp versions omit it)
    "S": u.COLLAPSED_SYMBOL + "$+<->^`|~",
}
_CATEGORY = re.compile(r"\\p\{(\w+)\}")
_MEMO_LIMIT = 1 << 16


def _to_collapsed(pattern: str) -> str:
    """Rewrite ``\\p{X}`` in ``pattern`` into classes over the collapsed alphabet."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            m = _CATEGORY.match(pattern, i)
            if m is not None:
                body = _CATEGORY_CLASS[m.group(1)]
                out.append(body if inside else f"[{body}]")
                i = m.end()
                continue
            out.append(pattern[i : i + 2])  # an escape: copy it whole
            i += 2
            continue
        if ch == "[" and not inside:
            inside = True
        elif ch == "]" and inside:
            inside = False
        out.append(ch)
        i += 1
    return "".join(out)


@attrs.frozen
class _Regex:
    """One split step; ``collapsed`` says which view of the text it runs on."""

    compiled: re.Pattern[str]
    collapsed: bool

    @classmethod
    def from_pattern(cls, pattern: str) -> _Regex:
        collapsed = _CATEGORY.search(pattern) is not None
        source = _to_collapsed(pattern) if collapsed else pattern
        return cls(re.compile(source, re.ASCII), collapsed)


@attrs.frozen
class PreTokenizer:
    """A named pre-tokenizer and the vocabulary flags llama.cpp ties to it."""

    name: str
    regexes: tuple[_Regex, ...]
    clean_spaces: bool = True  # detokenizer removes the space in " ," " 's" ...
    ignore_merges: bool = False  # a word that is itself a token skips BPE
    add_bos: bool = False  # default of add_bos when the GGUF does not say

    # per stage (from the second on): piece -> its words; bounded, filled lazily
    _memo: tuple[dict[str, list[str]], ...] = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: tuple({} for _ in self.regexes), takes_self=True),
    )

    def clear_memo(self) -> None:
        """Forget memoised piece splits."""
        for memo in self._memo:
            memo.clear()

    def split(self, text: str) -> list[str]:
        """The words of ``text``, in order; their concatenation is ``text``."""
        return self._split(text, 0)

    def _split(self, text: str, stage: int) -> list[str]:
        rx = self.regexes[stage]
        view = u.collapse(text) if rx.collapsed else u.widen(text)
        spans: list[tuple[int, int]] = []
        pos = 0
        for m in rx.compiled.finditer(view):
            a, b = m.span()
            if a > pos:
                spans.append((pos, a))
            if b > a:
                spans.append((a, b))
            pos = b
        if pos < len(text):
            spans.append((pos, len(text)))
        if stage + 1 == len(self.regexes):
            return [text[a:b] for a, b in spans]
        # Later regexes only see one piece at a time, so a piece's words can be memoised:
        # text repeats at the word level, which makes multi-regex splitting cheap.
        memo = self._memo[stage + 1]
        out: list[str] = []
        for a, b in spans:
            piece = text[a:b]
            words = memo.get(piece)
            if words is None:
                words = self._split(piece, stage + 1)
                if len(memo) >= _MEMO_LIMIT:
                    memo.clear()
                memo[piece] = words
            out.extend(words)
        return out


# --- the regexes, as llama.cpp (after the models' tokenizer.json) defines them ---------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_CASED = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# Cased letters (Lu/Ll/Lt) as listed in DeepSeek LLM's tokenizer.json.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+\Z",  # llama.cpp's "$": end of the piece only (Python's $ also matches before \n)
    _CJK_HANGUL,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)

# name(s) -> (regexes, clean_spaces, ignore_merges, add_bos); as in llama.cpp's vocab loader.
_TABLE: list[tuple[tuple[str, ...], tuple[str, ...], bool, bool, bool]] = [
    (("default",), _DEFAULT, True, False, False),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
        (_LLAMA3,),
        True,
        True,
        True,
    ),
    (("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), (_LLAMA3,), True, False, False),
    (("deepseek-llm",), _DEEPSEEK_LLM, False, False, False),
    (("deepseek-coder",), _DEEPSEEK_CODER, False, False, False),
    (("deepseek-v3", "hunyuan-dense"), _DEEPSEEK_V3, False, False, False),
    (("falcon",), _FALCON, True, False, False),
    (
        ("gpt-2", "mpt", "olmo", "jais", "phi-2", "jina-es", "jina-de", "gigachat", "exaone4"),
        (_GPT2,),
        True,
        False,
        False,
    ),
    (("trillion", "granite-docling"), (_GPT2,), False, False, False),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b"), _STARCODER, True, False, False),
    (("command-r", "smollm"), _STARCODER, False, False, False),
    (("qwen2", "deepseek-r1-qwen", "hunyuan", "grok-2"), (_QWEN2,), False, False, False),
    (("stablelm2", "megrez"), (_QWEN2,), True, False, False),
    (("qwen35",), (_QWEN35,), False, False, False),
    (("poro-chat",), (_PORO,), False, False, False),
    (("bloom", "gpt3-finnish"), (_PORO,), True, False, False),
    (("viking",), (_PORO, r"\p{N}"), False, False, False),
    (("gpt-4o", "llama4", "minimax-m2"), (_GPT4O_CASED,), False, False, False),
    (("tekken",), (_TEKKEN,), False, True, True),
]

_BY_NAME: dict[str, tuple[tuple[str, ...], bool, bool, bool]] = {
    name: (regexes, clean, ignore, bos)
    for names, regexes, clean, ignore, bos in _TABLE
    for name in names
}
_CACHE: dict[str, PreTokenizer] = {}


def supported_pre_tokenizers() -> list[str]:
    """Names accepted in ``tokenizer.ggml.pre`` (for a ``gpt2`` tokenizer)."""
    return sorted(_BY_NAME)


def pre_tokenizer_for(name: str) -> PreTokenizer:
    """The pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre == name``.

    A missing/empty name means ``"default"`` (llama.cpp does the same, with a warning that
    quality will be degraded). Unknown names raise :class:`UnsupportedTokenizerError`.
    """
    key = name or "default"
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    entry = _BY_NAME.get(key)
    if entry is None:
        raise UnsupportedTokenizerError(
            f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(supported_pre_tokenizers())}"
        )
    regexes, clean, ignore, bos = entry
    pre = PreTokenizer(
        name=key,
        regexes=tuple(_Regex.from_pattern(p) for p in regexes),
        clean_spaces=clean,
        ignore_merges=ignore,
        add_bos=bos,
    )
    _CACHE[key] = pre
    return pre
