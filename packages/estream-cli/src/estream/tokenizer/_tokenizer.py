"""The :class:`Tokenizer`: llama.cpp's BPE (``gpt2``) and SentencePiece (``llama``) vocabularies."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._errors import TokenIdError, UnsupportedTokenizerError, VocabularyError
from ._gguf import read_tokenizer_metadata
from ._merge import bpe_merge, spm_merge, spm_merge_heap
from ._pretok import PreTokenizer, pre_tokenizer_for

__all__ = ["TokenAttr", "Tokenizer"]


class TokenAttr(enum.IntFlag):
    """Per-token attributes (llama.cpp's ``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# plain ints for the hot paths (IntFlag arithmetic is slow over 150k tokens)
_UNKNOWN, _UNUSED, _NORMAL = int(TokenAttr.UNKNOWN), int(TokenAttr.UNUSED), int(TokenAttr.NORMAL)
_CONTROL, _USER_DEFINED = int(TokenAttr.CONTROL), int(TokenAttr.USER_DEFINED)
_BYTE = int(TokenAttr.BYTE)
# tokenizer.ggml.token_type values -> attributes (other values: UNDEFINED, 0)
_TYPE_TO_ATTR = {1: _NORMAL, 2: _UNKNOWN, 3: _CONTROL, 4: _USER_DEFINED, 5: _UNUSED, 6: _BYTE}

# Texts llama.cpp recognises as end-of-turn / end-of-generation / fill-in-the-middle markers
# and forces to CONTROL whatever their declared type (so they only match with parse_special).
_FORCED_CONTROL = frozenset(
    [
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
        "<｜end▁of▁sentence｜>", "[e~[", "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
        "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>",
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
        "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>",
        "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>",
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>",
        "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
    ]
)  # fmt: skip
# gpt-oss channel markers are always rendered: llama.cpp makes them USER_DEFINED.
_FORCED_USER_DEFINED = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])

_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(): what LSTRIP/RSTRIP strip next to special tokens
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (printable Latin-1 bytes map to themselves)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _byte_level_alphabet()
_BYTE_ENCODE = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}  # str.translate over latin-1
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
_WORD_CACHE_LIMIT = 1 << 17
_SPM_WORD = re.compile(f"{_SPM_SPACE}*[^{_SPM_SPACE}]+|{_SPM_SPACE}+")
_SPM_INNER_SPACE = re.compile(f"[^{_SPM_SPACE}]{_SPM_SPACE}")


def _split_merge(merge: str) -> tuple[str, str]:
    cut = merge.find(" ", 1)
    return (merge[:cut], merge[cut + 1 :]) if cut >= 0 else ("", "")


def _meta_int(meta: Mapping[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(value)


class Tokenizer:
    """A tokenizer built from GGUF metadata that reproduces llama.cpp's token ids exactly.

    Build it with :meth:`from_gguf` (or :meth:`from_metadata`). ``model`` is ``"gpt2"``
    (byte-level BPE with the ``pre`` pre-tokenizer) or ``"llama"`` (SentencePiece).
    """

    def __init__(self, meta: Mapping[str, Any], *, source: str = "<metadata>") -> None:
        model = str(meta.get("tokenizer.ggml.model", ""))
        if model not in ("gpt2", "llama"):
            raise UnsupportedTokenizerError(
                f"{source}: tokenizer model {model!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
            )
        self.model: str = model
        self.source = source
        attrs = self._read_vocabulary(meta)
        ids, add_bos, add_space_prefix, clean_spaces = self._read_model(meta)
        self._read_special_ids(meta, ids, add_bos, add_space_prefix, clean_spaces)
        self._mark_special(attrs, meta)
        self._attrs: list[int] = attrs
        self._piece_cache: dict[int, bytes] = {}
        # SPM merges run over a whole text fragment. When no token has a "▁" right after
        # another character, no merge can cross the start of a "▁..." word, so every word
        # merges on its own exactly as inside the fragment: tokenize per word, with a cache.
        self._spm_words = model == "llama" and not any(
            _SPM_INNER_SPACE.search(t) for t in self._texts
        )
        self._word_cache: dict[str, tuple[int, ...]] = {}

    def _read_vocabulary(self, meta: Mapping[str, Any]) -> list[int]:
        """Token texts, the text -> id map and scores; returns each token's attributes."""
        source = self.source
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(meta["tokenizer.ggml.tokens"])]
        n = len(texts)
        self._texts = texts
        token_to_id = dict(zip(texts, range(n)))
        if len(token_to_id) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(texts):
                if seen.setdefault(t, i) != i:
                    raise VocabularyError(
                        f"{source}: duplicate token {t!r} in vocabulary (ids {seen[t]} and {i})"
                    )
        self._token_to_id = token_to_id

        scores = meta.get("tokenizer.ggml.scores")
        self._scores: list[float] = [0.0] * n if scores is None else [float(s) for s in scores]
        if len(self._scores) < n:
            raise VocabularyError(f"{source}: {len(self._scores)} scores for {n} tokens")
        self._finite_scores = all(math.isfinite(x) for x in self._scores)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            return [_NORMAL] * n
        if len(types) < n:
            raise VocabularyError(f"{source}: {len(types)} token types for {n} tokens")
        type_list = types.tolist() if hasattr(types, "tolist") else list(types)
        return [_TYPE_TO_ATTR.get(t, 0) for t in type_list[:n]]

    def _read_model(
        self, meta: Mapping[str, Any]
    ) -> tuple[dict[str, int | None], bool, bool, bool]:
        """The model's pre-tokenizer and merges; returns its default special ids and flags
        (bos/eos/unk, add_bos, add_space_prefix, clean_spaces) before the GGUF keys apply."""
        bos: int | None
        unk: int | None
        if self.model == "llama":
            bos, eos, unk = 1, 2, 0
            self.pre: str = str(meta.get("tokenizer.ggml.pre") or "default")
            self._pretok: PreTokenizer | None = None
            add_bos, add_space_prefix, clean_spaces = True, True, False
            self._ranks: dict[tuple[str, str], int] = {}
        else:
            bos, eos, unk = 11, 11, None
            self._pretok = pre_tokenizer_for(str(meta.get("tokenizer.ggml.pre") or ""))
            self.pre = self._pretok.name
            add_bos, add_space_prefix = self._pretok.add_bos, False
            clean_spaces = self._pretok.clean_spaces
            if self.pre in ("chatglm-bpe", "glm4"):
                bos = None
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise VocabularyError(
                    f"{self.source}: BPE vocabulary without 'tokenizer.ggml.merges'"
                )
            # "left right", split at the first space after the first character; the first
            # occurrence of a pair keeps its rank (llama.cpp's map emplace)
            pairs = [_split_merge(m) for m in merges]
            self._ranks = dict(zip(reversed(pairs), range(len(pairs) - 1, -1, -1)))
        return {"bos": bos, "eos": eos, "unk": unk}, add_bos, add_space_prefix, clean_spaces

    def _read_special_ids(
        self,
        meta: Mapping[str, Any],
        ids: dict[str, int | None],
        add_bos: bool,
        add_space_prefix: bool,
        clean_spaces: bool,
    ) -> None:
        """BOS/EOS/UNK ids and the add_* flags: the model's defaults, then the GGUF keys (as
        llama.cpp's loader does); ids outside the vocabulary are dropped."""
        n, source = len(self._texts), self.source
        for name in ids:
            if ids[name] is not None and ids[name] >= n:
                ids[name] = None
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown")):
            value = _meta_int(meta, f"tokenizer.ggml.{key}_token_id")
            if value is not None and 0 <= value < n:
                ids[name] = value
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.unk_id: int | None = ids["unk"]
        if "tokenizer.ggml.add_bos_token" in meta:
            add_bos = bool(meta["tokenizer.ggml.add_bos_token"])
        self.add_bos: bool = add_bos
        self.add_eos: bool = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if "tokenizer.ggml.add_space_prefix" in meta:
            add_space_prefix = bool(meta["tokenizer.ggml.add_space_prefix"])
        self.add_space_prefix: bool = add_space_prefix
        self.clean_spaces: bool = clean_spaces
        if self.add_bos and self.bos_id is None:
            raise VocabularyError(f"{source}: add_bos_token is true but there is no BOS token id")
        if self.add_eos and self.eos_id is None:
            raise VocabularyError(f"{source}: add_eos_token is true but there is no EOS token id")

    def _mark_special(self, attrs: list[int], meta: Mapping[str, Any]) -> None:
        """Forced control / user-defined tokens, the special-token match order and the
        strip rules, applied to ``attrs`` in place."""
        texts, token_to_id = self._texts, self._token_to_id
        for text in _FORCED_CONTROL:
            tid = token_to_id.get(text)
            if tid is not None:
                attrs[tid] |= TokenAttr.CONTROL
        for text in _FORCED_USER_DEFINED:
            tid = token_to_id.get(text)
            if tid is not None:
                attrs[tid] = TokenAttr.USER_DEFINED
        self._fix_harmony_end(attrs)
        special = _CONTROL | _USER_DEFINED | _UNKNOWN
        # longest first; equal lengths by id (llama.cpp's order among those is unspecified)
        self._special_ids = sorted(
            (i for i in range(len(texts)) if attrs[i] & special),
            key=lambda i: (-len(texts[i]), i),
        )
        self._special_chars = [frozenset(texts[i]) for i in self._special_ids]
        self._apply_strip_rules(attrs, str(meta.get("general.name", "")).lower())

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read the tokenizer of a GGUF (model or vocabulary-only) or packed model dir."""
        return cls(read_tokenizer_metadata(path), source=str(path))

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from already-read ``tokenizer.ggml.*`` metadata (a mapping of key -> value)."""
        return cls(meta)

    def _fix_harmony_end(self, attrs: list[int]) -> None:
        # o200k_harmony / solar-open: "<|end|>" is not end-of-generation, and is rendered
        has = self._token_to_id.__contains__
        if has("<|end|>") and (
            (has("<|return|>") and has("<|call|>")) or (has("<|calls|>") and has("<|flush|>"))
        ):
            attrs[self._token_to_id["<|end|>"]] = TokenAttr.USER_DEFINED

    def _apply_strip_rules(self, attrs: list[int], model_name: str) -> None:
        """Per-model whitespace stripping around special tokens (llama.cpp sets it by name)."""
        pre = self.pre
        t2i = self._token_to_id
        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")):
            if "<mask>" in t2i:
                attrs[t2i["<mask>"]] |= TokenAttr.LSTRIP
        elif "phi-3" in model_name or "phi3" in model_name:
            for tid in self._special_ids:
                attrs[tid] |= TokenAttr.RSTRIP
            if "</s>" in t2i:
                attrs[t2i["</s>"]] |= TokenAttr.RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in t2i:
                    attrs[t2i[text]] &= ~TokenAttr.RSTRIP
        elif "modern-bert" in model_name and "[MASK]" in t2i:
            attrs[t2i["[MASK]"]] |= TokenAttr.LSTRIP

    def clear_caches(self) -> None:
        """Forget memoised words (BPE/SPM results and pre-tokenizer splits); for benchmarks."""
        self._word_cache.clear()
        if self._pretok is not None:
            self._pretok.clear_memo()

    # ------------------------------------------------------------------ properties

    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._texts)

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary text of a token (byte-level or with "▁", as stored)."""
        self._check_id(token_id)
        return self._texts[token_id]

    def token_attr(self, token_id: int) -> TokenAttr:
        """The attributes llama.cpp gives the token (type, plus forced CONTROL etc.)."""
        self._check_id(token_id)
        return TokenAttr(self._attrs[token_id])

    def text_to_id(self, text: str) -> int | None:
        """The id of the token whose vocabulary text is exactly ``text``, or None."""
        return self._token_to_id.get(text)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})"
        )

    # ------------------------------------------------------------------ encoding

    def encode(
        self, text: str, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` returns them.

        ``add_special`` adds BOS/EOS where the model asks for them (``add_bos``/``add_eos``);
        ``parse_special`` lets control tokens written in the text (``<|im_start|>``) become
        those tokens. User-defined tokens are always matched as whole strings.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes text as str, not {type(text).__name__}")
        fragments = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if self.model == "llama":
            if add_special and self.add_bos:
                out.append(self.bos_id)  # type: ignore[arg-type]
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_tokenize(frag.replace(" ", _SPM_SPACE), out)
                prev_special = False
            if add_special and self.add_eos:
                out.append(self.eos_id)  # type: ignore[arg-type]
            return out
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
            else:
                self._bpe_tokenize(frag, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split ``text`` around special tokens, longest tokens first (tokenizer_st_partition)."""
        fragments: list[str | int] = [text]
        skip = TokenAttr.CONTROL | TokenAttr.UNKNOWN
        texts, attrs = self._texts, self._attrs
        present = set(text)  # cheap filter: a token with a character not in the text is absent
        for tid, chars in zip(self._special_ids, self._special_chars):
            attr = attrs[tid]
            if not parse_special and attr & skip:
                continue
            if not chars <= present:
                continue
            tok = texts[tid]
            if tok not in text:
                continue
            lstrip = bool(attr & TokenAttr.LSTRIP)
            rstrip = bool(attr & TokenAttr.RSTRIP)
            new: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok)
                for k, part in enumerate(parts):
                    if k > 0:
                        new.append(tid)
                        if rstrip:
                            part = part.lstrip(_ASCII_SPACE)
                    if k < len(parts) - 1 and lstrip:
                        part = part.rstrip(_ASCII_SPACE)
                    if part:
                        new.append(part)
            fragments = new
        return fragments

    def _bpe_tokenize(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        assert self._pretok is not None
        for word in self._pretok.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        encoded = word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_BYTE_ENCODE)
        t2i = self._token_to_id
        if self._pretok is not None and self._pretok.ignore_merges:
            tid = t2i.get(encoded)
            if tid is not None:
                return (tid,)
        ids: list[int] = []
        for sym in bpe_merge(encoded, self._ranks):
            tid = t2i.get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            # not a token: llama.cpp looks up each byte of the symbol's UTF-8 on its own
            for b in sym.encode("utf-8"):
                single = chr(b) if b < 0x80 else chr(0xDC00 + b)  # surrogateescape'd byte
                tid = t2i.get(single)
                if tid is not None:
                    ids.append(tid)
        return tuple(ids)

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        if not self._spm_words:
            self._spm_pieces(text, out)
            return
        cache = self._word_cache
        for word in _SPM_WORD.findall(text):
            ids = cache.get(word)
            if ids is None:
                buf: list[int] = []
                self._spm_pieces(word, buf)
                ids = tuple(buf)
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _spm_pieces(self, text: str, out: list[int]) -> None:
        t2i = self._token_to_id
        merge = spm_merge if self._finite_scores else spm_merge_heap
        for piece in merge(text, t2i.get, self._scores):
            tid = t2i.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            for b in piece.encode("utf-8", "surrogatepass"):
                tid = t2i.get(f"<0x{b:02X}>")
                if tid is None:
                    tid = t2i.get(chr(b) if b < 0x80 else chr(0xDC00 + b))
                if tid is None:
                    raise VocabularyError(
                        f"{self.source}: SentencePiece vocabulary has no byte token <0x{b:02X}> "
                        f"for byte fallback of {piece!r}"
                    )
                out.append(tid)

    # ------------------------------------------------------------------ decoding

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._texts):
            raise TokenIdError(f"token id {token_id} is outside the vocabulary [0, {self.n_vocab})")

    def _piece(self, token_id: int) -> bytes:
        """The bytes a token renders to, special tokens included (llama.cpp's piece cache)."""
        piece = self._piece_cache.get(token_id)
        if piece is not None:
            return piece
        self._check_id(token_id)
        attr = self._attrs[token_id]
        text = self._texts[token_id]
        if attr & (_UNKNOWN | _CONTROL | _USER_DEFINED):
            piece = text.encode("utf-8", "surrogateescape")
        elif attr & _NORMAL:
            if self.model == "llama":
                piece = text.replace(_SPM_SPACE, " ").encode("utf-8", "surrogateescape")
            else:
                piece = self._byte_level_decode(text)
        elif attr & _BYTE:
            piece = bytes([int(text[3:5], 16)])
        else:  # UNUSED / UNDEFINED render as nothing
            piece = b""
        self._piece_cache[token_id] = piece
        return piece

    @staticmethod
    def _byte_level_decode(text: str) -> bytes:
        out = bytearray()
        for ch in text:
            b = _CHAR_TO_BYTE.get(ch)
            if b is not None:
                out.append(b)
            else:  # not a byte-level character: llama.cpp emits this marker
                utf8 = ch.encode("utf-8", "surrogateescape")
                out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)

    def token_to_bytes(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes of one token; with ``special=False`` control/unknown tokens give b""."""
        piece = self._piece(token_id)
        if not special and self._attrs[token_id] & (_UNKNOWN | _CONTROL):
            return b""
        return piece

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token (special tokens rendered; partial UTF-8 shown as U+FFFD)."""
        return self._piece(token_id).decode("utf-8", "replace")

    def decode_bytes(self, ids: Sequence[int], *, skip_special: bool = False) -> bytes:
        """The bytes of ``ids`` as llama.cpp's ``llama_detokenize`` produces them.

        ``skip_special`` drops control/unknown tokens and a leading BOS / trailing EOS that
        the model adds itself (llama.cpp's ``remove_special`` + ``!unparse_special``).
        """
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        hidden = _UNKNOWN | _CONTROL
        chunks: list[bytes] = []
        for tid in ids:
            piece = self._piece(int(tid))
            if skip_special and self._attrs[tid] & hidden:
                piece = b""
            elif remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            chunks.append(piece)
        data = b"".join(chunks)
        return _clean_spaces(data) if self.clean_spaces else data

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of ``ids`` (see :meth:`decode_bytes`); invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's detokenizer clean-up: " ?" -> "?", " ' " -> "'", " 's" -> "'s", ..."""
    if not data:
        return data
    # 1: drop a space before ? ! . ,
    out = bytearray(data[:1])
    for i in range(1, len(data)):
        x = data[i]
        if data[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    # 2: " ' " -> "'" (a lone apostrophe between spaces)
    src = bytes(out)
    out = bytearray(src[:1])
    i = 1
    dropped = -1  # llama.cpp blanks the dropped space in place: it no longer counts as " "
    while i < len(src):
        x = src[i]
        prev_space = src[i - 1] == 0x20 and dropped != i - 1
        if x == 0x27 and i + 1 < len(src) and prev_space and src[i + 1] == 0x20:
            out.pop()
            out.append(x)
            dropped = i + 1
            i += 2
            continue
        out.append(x)
        i += 1
    # 3: " 's" " 'm" " 're" " 've" -> no space (but " 't" " 'd" " 'll" keep it)
    src = bytes(out)
    out = bytearray(src[:1])
    n = len(src)
    for i in range(1, n):
        x = src[i]
        if src[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = src[i + 1]
            if x1 in b"sm" or (i + 2 < n and (src[i + 1 : i + 3] in (b"re", b"ve"))):
                out.pop()
        out.append(x)
    return bytes(out)
