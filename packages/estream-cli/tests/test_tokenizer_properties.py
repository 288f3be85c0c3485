"""Property tests of the tokenizer's parts: merge loops, pre-tokenizers, round trips."""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estream.tokenizer import Tokenizer, read_tokenizer_metadata, supported_pre_tokenizers
from estream.tokenizer._merge import bpe_merge_heap, bpe_merge_scan, spm_merge, spm_merge_heap
from estream.tokenizer._pretok import pre_tokenizer_for
from estream.tokenizer._unicode import collapse, is_whitespace
from estream.tokenizer.testing import find_vocab_dir

VOCAB_DIR = find_vocab_dir()

# Characters that exercise every class the pre-tokenizers distinguish.
TRICKY = (
    " \t\n\r\x0b\x0c\x1c\x85\xa0\u2000\u3000'sStTmMdDlLrReEvV"
    'aZz09½²٣!"#$%&()*+,-./:;<=>?@[\\]^_`{|}~我工가힣нещоéÄửµ\u0301\u200d\ufe0f'
    "🚀😁🦙～！、。‘…۔\ue000\u0378øö"
)
texts = st.text(alphabet=st.sampled_from(TRICKY), max_size=40) | st.text(max_size=40)


def vocab_path(name: str) -> Path:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.fail(f"{path.name} not found in {VOCAB_DIR} (estream-layout's package data)")
    return path


@functools.cache
def load(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(vocab_path(name))


@st.composite
def words_and_ranks(draw: st.DrawFn) -> tuple[str, dict[tuple[str, str], int]]:
    """A word over a tiny alphabet and a random merge table closed over its pieces."""
    word = draw(st.text(alphabet="abc", min_size=0, max_size=60))
    pieces = ["a", "b", "c"]
    ranks: dict[tuple[str, str], int] = {}
    for rank in range(draw(st.integers(0, 25))):
        left = draw(st.sampled_from(pieces))
        right = draw(st.sampled_from(pieces))
        if (left, right) not in ranks:
            ranks[(left, right)] = rank
            pieces.append(left + right)
    return word, ranks


@given(words_and_ranks())
def test_bpe_heap_matches_rescan(case: tuple[str, dict[tuple[str, str], int]]) -> None:
    word, ranks = case
    scan = bpe_merge_scan(word, ranks)
    assert bpe_merge_heap(word, ranks) == scan
    assert "".join(scan) == word
    # no adjacent pair left that could still merge
    assert all((a, b) not in ranks for a, b in itertools.pairwise(scan))


@given(
    text=st.text(alphabet="abc", max_size=60),
    table=st.dictionaries(
        st.text(alphabet="abc", min_size=2, max_size=4), st.integers(-3, 3), max_size=30
    ),
)
def test_spm_scan_matches_heap(text: str, table: dict[str, int]) -> None:
    # small integer scores: many ties, which must go to the leftmost pair
    ids = {piece: i for i, piece in enumerate(table)}
    scores = [float(table[piece]) for piece in ids]
    scan = spm_merge(text, ids.get, scores)
    assert spm_merge_heap(text, ids.get, scores) == scan
    assert "".join(scan) == text
    assert all(a + b not in ids for a, b in itertools.pairwise(scan))


@pytest.mark.parametrize("name", supported_pre_tokenizers())
@given(text=texts)
def test_pre_tokenizer_covers_text(name: str, text: str) -> None:
    words = pre_tokenizer_for(name).split(text)
    assert "".join(words) == text
    assert all(words)


def test_pre_tokenizer_examples() -> None:
    # hand-derived from the regexes: GPT-2 keeps the space before a word, leaves a space run
    # minus one, splits contractions; Llama-3 groups digits by three; Qwen2 digit by digit
    gpt2 = pre_tokenizer_for("gpt-2").split
    assert gpt2("Hello  world's 123!!") == ["Hello", " ", " world", "'s", " 123", "!!"]
    assert pre_tokenizer_for("llama3").split("12345 ab") == ["123", "45", " ab"]
    assert pre_tokenizer_for("qwen2").split("x12") == ["x", "1", "2"]
    # \x1c is not White_Space for llama.cpp (Python's isspace() says it is)
    assert gpt2("a\x1cb") == ["a", "\x1c", "b"]
    assert pre_tokenizer_for("deepseek-llm").split("ab  ") == ["ab", "  "]


def test_collapse_classes() -> None:
    assert collapse("aé1½ \u3000~\u0301") == "a\xd21\xd1 \x0b~\xd4"
    assert is_whitespace(0x85) and is_whitespace(0x3000) and not is_whitespace(0x1C)


@pytest.mark.parametrize("name", ["qwen2", "deepseek-llm", "llama-spm"])
@given(text=texts)
def test_round_trip(name: str, text: str) -> None:
    tok = load(name)
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text


@given(text=texts)
def test_round_trip_with_cleanup(text: str) -> None:
    tok = load("mpt")  # clean_spaces: only texts the clean-up leaves alone round-trip
    if re.search(r" [?!.,]| ' | '(s|m|re|ve)", text):
        return
    assert tok.decode(tok.encode(text)) == text


@given(text=texts)
def test_spm_per_word_equals_whole_fragment(text: str) -> None:
    tok = load("llama-spm")
    assert tok._spm_words  # the llama vocabulary allows per-word merging
    per_word = tok.encode(text)
    tok._spm_words = False
    try:
        whole = tok.encode(text)
    finally:
        tok._spm_words = True
    assert per_word == whole


def test_spm_inner_space_token_disables_per_word() -> None:
    meta = read_tokenizer_metadata(vocab_path("llama-spm"))
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[31999] = "a\u2581b"
    assert not Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens})._spm_words
