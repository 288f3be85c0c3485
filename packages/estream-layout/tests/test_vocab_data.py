"""The vocabulary files shipped as package data: present where the package is installed, with
their licence, and used by synthetic models of the presets that ask for a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

import estream_layout
from estream_layout.gguf_header import read_header
from estream_layout.synth import DEFAULT_VOCABS, VOCAB_DIR, find_vocab, synth_model

TOKENS = "tokenizer.ggml.tokens"


def test_vocab_dir_is_inside_the_installed_package() -> None:
    assert VOCAB_DIR.parent == Path(estream_layout.__file__).resolve().parent
    assert (VOCAB_DIR / "LICENSE-llama.cpp").read_text().startswith("MIT License")
    assert "llama.cpp" in (VOCAB_DIR / "README.md").read_text()


@pytest.mark.parametrize("arch", sorted(DEFAULT_VOCABS))
def test_every_family_vocabulary_ships_with_its_test_vectors(arch: str, monkeypatch) -> None:
    monkeypatch.delenv("ESTREAM_VOCAB_DIR", raising=False)
    path = find_vocab(arch)
    assert path == VOCAB_DIR / DEFAULT_VOCABS[arch]
    assert len(read_header(path).kv[TOKENS]) > 30000  # a real vocabulary, not a stub
    for ext in (".inp", ".out"):
        assert Path(f"{path}{ext}").stat().st_size > 1000


def test_env_override_wins_and_a_missing_file_falls_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ESTREAM_VOCAB_DIR", str(tmp_path))
    assert find_vocab("olmoe") == VOCAB_DIR / "ggml-vocab-mpt.gguf"  # not in tmp_path
    (tmp_path / "ggml-vocab-mpt.gguf").write_bytes(b"")
    assert find_vocab("olmoe") == tmp_path / "ggml-vocab-mpt.gguf"
    assert find_vocab("lfm2moe") is None  # no real vocabulary for that family


def test_small_preset_carries_the_family_tokenizer(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("ESTREAM_VOCAB_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing around the working directory matters
    out = synth_model("qwen3moe", "small", tmp_path / "m.gguf", seed=1, n_layers=1)
    want = read_header(VOCAB_DIR / "ggml-vocab-qwen2.gguf").kv[TOKENS]
    assert list(read_header(out).kv[TOKENS]) == list(want)
