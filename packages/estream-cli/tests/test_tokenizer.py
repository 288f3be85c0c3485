"""The GGUF tokenizer against llama.cpp's own test vectors, plus special tokens and errors.

The vectors shipped in estream-layout's ``data/`` (``ggml-vocab-*.gguf`` + ``.inp``/``.out``)
are llama.cpp's; every string must give exactly the ids llama.cpp gives (add_special=False,
parse_special=False, as test-tokenizer-0 runs them). Expected values elsewhere are derived by
hand from the rules (or are vocabulary lookups), never from our own encoder's output.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from estream.tokenizer import (
    GGUFReadError,
    MissingTokenizerError,
    TokenAttr,
    TokenIdError,
    Tokenizer,
    UnsupportedTokenizerError,
    VocabularyError,
    read_tokenizer_metadata,
)
from estream.tokenizer._tokenizer import _clean_spaces
from estream.tokenizer.testing import find_vocab_dir, read_vocab_tests, vocab_files

VOCAB_DIR = find_vocab_dir()
_MISSING = "<vocab dir empty>"
VOCAB_NAMES = [
    p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in vocab_files(VOCAB_DIR)
] or [_MISSING]
# the vocabularies the issue names; all must be present (a missing one is a failure)
REQUIRED = {"deepseek-llm", "llama-spm", "mpt", "qwen2"}


def vocab_path(name: str) -> Path:
    if name == _MISSING:
        pytest.fail(
            f"llama.cpp vocabulary vectors not found in {VOCAB_DIR}: estream-layout ships them "
            "in estream_layout/data/ (is its package data installed?)"
        )
    return VOCAB_DIR / f"ggml-vocab-{name}.gguf"


@functools.cache
def load(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(vocab_path(name))


def test_required_vocabularies_present() -> None:
    if VOCAB_NAMES == [_MISSING]:
        vocab_path(_MISSING)
    assert set(VOCAB_NAMES) >= REQUIRED, f"missing vocabularies in {VOCAB_DIR}"


# ------------------------------------------------------------------------- llama.cpp vectors


@pytest.mark.parametrize("name", VOCAB_NAMES)
def test_llama_cpp_vectors(name: str) -> None:
    tok = load(name)
    cases = read_vocab_tests(vocab_path(name))
    assert len(cases) >= 40, "the vector files look truncated"
    failures = []
    for text, expected in cases:
        got = tok.encode(text)
        if got != expected:
            failures.append(f"{text!r}: expected {expected}, got {got}")
    assert not failures, f"{len(failures)}/{len(cases)} mismatches:\n" + "\n".join(failures)


def _cleanup_changes(text: str) -> bool:
    """Would llama.cpp's detokenizer space clean-up alter ``text``? (hand-written rule list)"""
    pats = [" ?", " !", " .", " ,", " ' ", " 's", " 'm", " 're", " 've"]
    return any(p in text for p in pats)


@pytest.mark.parametrize("name", VOCAB_NAMES)
def test_round_trip_of_vectors(name: str) -> None:
    tok = load(name)
    checked = 0
    for text, expected in read_vocab_tests(vocab_path(name)):
        if tok.clean_spaces and _cleanup_changes(text):
            continue
        assert tok.decode(expected) == text
        assert tok.decode(tok.encode(text)) == text
        checked += 1
    assert checked >= 40


@pytest.mark.parametrize("name", VOCAB_NAMES)
def test_add_special_round_trip(name: str) -> None:
    tok = load(name)
    for text, expected in read_vocab_tests(vocab_path(name)):
        ids = tok.encode(text, add_special=True)
        head = [tok.bos_id] if tok.add_bos else []
        tail = [tok.eos_id] if tok.add_eos else []
        assert ids == head + expected + tail
        if not (tok.clean_spaces and _cleanup_changes(text)):
            # llama.cpp keeps SPM's prefix space when it removes the BOS before it
            keep_space = tok.add_space_prefix and tok.add_bos and text
            assert tok.decode(ids, skip_special=True) == (" " + text if keep_space else text)


# ------------------------------------------------------------------------- metadata and flags


def test_metadata_flags() -> None:
    spm = load("llama-spm")
    assert (spm.model, spm.bos_id, spm.eos_id, spm.add_bos, spm.add_eos) == (
        "llama",
        1,
        2,
        True,
        False,
    )
    assert spm.n_vocab == 32000
    qwen = load("qwen2")
    assert (qwen.model, qwen.pre, qwen.add_bos, qwen.bos_id) == ("gpt2", "qwen2", False, 151643)
    ds = load("deepseek-llm")
    assert (ds.pre, ds.add_bos, ds.bos_id, ds.eos_id) == ("deepseek-llm", True, 100000, 100001)
    mpt = load("mpt")
    assert (mpt.pre, mpt.add_bos, mpt.clean_spaces) == ("mpt", False, True)
    assert mpt.token_to_piece(mpt.text_to_id("Ġworld")) == " world"


def test_fast_reader_agrees_with_gguf_reader() -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    for name in ("llama-spm",):  # strings, float32, int32, uint32 and bool keys
        ours = read_tokenizer_metadata(vocab_path(name))
        fields = gguf.GGUFReader(vocab_path(name)).fields
        for key, field in fields.items():
            if not key.startswith("tokenizer.ggml."):
                continue
            theirs = field.contents()
            if isinstance(theirs, list) and theirs and not isinstance(theirs[0], str):
                np.testing.assert_array_equal(ours[key], np.asarray(theirs), err_msg=key)
            else:
                assert ours[key] == theirs, key


# ------------------------------------------------------------------------- special tokens


def test_control_tokens_need_parse_special() -> None:
    tok = load("qwen2")
    im_start, im_end = tok.text_to_id("<|im_start|>"), tok.text_to_id("<|im_end|>")
    assert tok.token_attr(im_start) & TokenAttr.CONTROL
    body = "user\nhi there"
    text = f"<|im_start|>{body}<|im_end|>"
    assert tok.encode(text, parse_special=True) == [im_start, *tok.encode(body), im_end]
    plain = tok.encode(text)
    assert im_start not in plain and im_end not in plain
    assert tok.decode(plain) == text
    # decoding renders control tokens unless asked to skip them
    ids = tok.encode(text, parse_special=True)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == body


def test_user_defined_tokens_always_match_longest_first() -> None:
    tok = load("mpt")  # GPT-NeoX: runs of 2..24 spaces are USER_DEFINED tokens
    two, five = tok.text_to_id("  "), tok.text_to_id("     ")
    assert tok.token_attr(two) & TokenAttr.USER_DEFINED
    assert tok.encode("a  b") == [*tok.encode("a"), two, *tok.encode("b")]
    assert tok.encode("     ") == [five]
    assert tok.encode("x" + " " * 7) == [*tok.encode("x"), tok.text_to_id(" " * 7)]


def test_spm_special_tokens_and_space_prefix() -> None:
    tok = load("llama-spm")
    hello = tok.text_to_id("▁Hello")
    assert tok.encode("Hello") == [hello]  # the leading-space rule: "Hello" -> "▁Hello"
    assert tok.encode("<s>Hello", parse_special=True) == [tok.bos_id, hello]
    assert tok.bos_id not in tok.encode("<s>Hello")
    assert tok.encode("Hello", add_special=True) == [tok.bos_id, hello]
    assert tok.decode([hello]) == "Hello"  # the added space is removed again
    assert tok.decode([tok.bos_id, hello], skip_special=True) == " Hello"  # as llama.cpp
    # byte fallback: a character without a piece becomes its UTF-8 bytes
    byte_ids = [tok.text_to_id(f"<0x{b:02X}>") for b in "\U0001f999".encode()]
    ids = tok.encode("\U0001f999")
    assert ids[-4:] == byte_ids
    assert tok.decode(ids) == "\U0001f999"


def test_forced_control_and_strip_rules() -> None:
    meta = read_tokenizer_metadata(vocab_path("mpt"))
    types = meta["tokenizer.ggml.token_type"].copy()
    types[0] = 1  # declare "<|endoftext|>" NORMAL: llama.cpp still treats it as CONTROL
    tok = Tokenizer.from_metadata({**meta, "tokenizer.ggml.token_type": types})
    assert tok.token_text(0) == "<|endoftext|>"
    assert tok.token_attr(0) & TokenAttr.CONTROL
    assert 0 not in tok.encode("a<|endoftext|>b")
    assert tok.encode("a<|endoftext|>b", parse_special=True) == [
        *tok.encode("a"),
        0,
        *tok.encode("b"),
    ]
    # phi-3: special tokens swallow the whitespace after them (RSTRIP), except <s>/<unk>
    spm = read_tokenizer_metadata(vocab_path("llama-spm"))
    phi = Tokenizer.from_metadata({**spm, "general.name": "Phi-3 mini"})
    assert phi.token_attr(2) & TokenAttr.RSTRIP and not phi.token_attr(1) & TokenAttr.RSTRIP
    assert phi.encode("a</s> \t b", parse_special=True) == [*phi.encode("a"), 2, *phi.encode("b")]
    plain = load("llama-spm")
    assert plain.encode("a</s> b", parse_special=True) == [
        *plain.encode("a"),
        2,
        *plain.encode(" b"),
    ]


def test_encode_rejects_bytes() -> None:
    with pytest.raises(TypeError, match="str"):
        load("mpt").encode(b"bytes")  # type: ignore[arg-type]


def test_add_special_follows_metadata() -> None:
    meta = read_tokenizer_metadata(vocab_path("mpt"))
    base = Tokenizer.from_metadata(meta)
    assert base.encode("hi", add_special=True) == base.encode("hi")  # no add_bos key: off
    both = Tokenizer.from_metadata(
        {**meta, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    )
    assert both.encode("hi", add_special=True) == [0, *base.encode("hi"), 0]
    assert both.decode(both.encode("hi", add_special=True), skip_special=True) == "hi"
    no_bos = {k: v for k, v in meta.items() if k != "tokenizer.ggml.bos_token_id"}
    # without a bos id a gpt2 vocabulary falls back to id 11, as llama.cpp does
    assert Tokenizer.from_metadata(no_bos).bos_id == 11


def test_detokenizer_space_cleanup_rules() -> None:
    assert _clean_spaces(b"a , b . c ? d !") == b"a, b. c? d!"
    assert _clean_spaces(b"x ' y") == b"x'y"
    assert _clean_spaces(b"he 's, I 'm, we 're, they 've") == b"he's, I'm, we're, they've"
    assert _clean_spaces(b"don 't, he 'd, I 'll") == b"don 't, he 'd, I 'll"
    tok = load("mpt")
    assert tok.decode(tok.encode("Hello , world !")) == "Hello, world!"
    assert load("qwen2").decode(load("qwen2").encode("Hello , world !")) == "Hello , world !"


# ------------------------------------------------------------------------- errors


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFReadError, match="not a GGUF"):
        Tokenizer.from_gguf(bad)
    with pytest.raises(GGUFReadError, match="does not exist"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(GGUFReadError, match=r"model\.gguf"):
        Tokenizer.from_gguf(tmp_path)


def test_truncated_gguf(tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(vocab_path("mpt").read_bytes()[:5000])
    with pytest.raises(GGUFReadError, match="truncated"):
        Tokenizer.from_gguf(cut)


def test_corrupt_header_is_a_tokenizer_error(tmp_path: Path) -> None:
    """A header the reader cannot parse (here the first value's type is 99) is the tokenizer's
    own GGUFReadError naming the file, not the reader's ValueError."""
    data = bytearray(vocab_path("mpt").read_bytes())
    key_len = int.from_bytes(data[24:32], "little")
    type_at = 32 + key_len
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFReadError, match=r"bad\.gguf: corrupt GGUF header"):
        Tokenizer.from_gguf(bad)


def test_metadata_is_read_by_the_layout_header_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer has no GGUF parser of its own: its metadata is what estream-layout's
    `read_header` returns, token texts decoded with surrogate escapes."""
    from estream.tokenizer import _gguf
    from estream_layout import gguf_header

    calls: list[tuple[Path, str]] = []

    def spy(path: Path, *, strings: str = "replace") -> gguf_header.GGUFHeader:
        calls.append((Path(path), strings))
        return gguf_header.read_header(path, strings=strings)

    monkeypatch.setattr(_gguf, "read_header", spy)
    meta = read_tokenizer_metadata(vocab_path("mpt"))
    assert calls == [(vocab_path("mpt"), "surrogateescape")]
    assert (
        meta["tokenizer.ggml.tokens"]
        == gguf_header.read_header(vocab_path("mpt")).kv["tokenizer.ggml.tokens"]
    )


def test_token_texts_keep_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    """A token whose bytes are not UTF-8 keeps them (as surrogate escapes), and numeric arrays
    come back as numpy arrays of the stored type."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bytes.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    raw = [b"<unk>", b"\xff\xfe", b"a"]
    w.add_token_list(raw)
    w.add_token_scores([0.0, -1.5, -2.0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = read_tokenizer_metadata(path)
    assert [t.encode("utf-8", "surrogateescape") for t in meta["tokenizer.ggml.tokens"]] == raw
    scores = meta["tokenizer.ggml.scores"]
    assert isinstance(scores, np.ndarray) and scores.dtype == np.float32
    assert scores.tolist() == [0.0, -1.5, -2.0]


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MissingTokenizerError, match=r"tokenizer\.ggml\.model"):
        Tokenizer.from_gguf(path)


def test_packed_model_directory(tmp_path: Path) -> None:
    packed = tmp_path / "mpt.estream"
    packed.mkdir()
    (packed / "model.gguf").symlink_to(vocab_path("mpt"))
    assert Tokenizer.from_gguf(packed).encode("Hello world") == load("mpt").encode("Hello world")


def test_unsupported_models() -> None:
    meta = read_tokenizer_metadata(vocab_path("mpt"))
    with pytest.raises(UnsupportedTokenizerError, match="'bert'"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedTokenizerError, match="no-such-pre"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "no-such-pre"})
    dup = list(meta["tokenizer.ggml.tokens"])
    dup[5] = dup[6]
    with pytest.raises(VocabularyError, match="duplicate"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": dup})
    spm = read_tokenizer_metadata(vocab_path("llama-spm"))
    with pytest.raises(VocabularyError, match="BOS"):
        # one token: the default BOS id 1 and the given one are both out of range
        Tokenizer.from_metadata(
            {**spm, "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.bos_token_id": 10**6}
        )


def test_bad_token_ids() -> None:
    tok = load("qwen2")
    with pytest.raises(TokenIdError):
        tok.decode([tok.n_vocab])
    with pytest.raises(TokenIdError):
        tok.token_to_piece(-1)
