from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from estream_layout.gguf_header import read_header
from estream_layout.gguf_model import ModelSpec


@pytest.mark.parametrize("arch", ["olmoe", "deepseek2", "lfm2moe"])
def test_header_matches_gguf_reader(arch: str, tiny_models: dict[str, Path]) -> None:
    path = tiny_models[arch]
    ours = read_header(path)
    ref = gguf.GGUFReader(path)
    ref_kv = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.kv) == set(ref_kv)
    for k, v in ref_kv.items():
        if isinstance(v, float):
            assert ours.kv[k] == pytest.approx(v)
        else:
            assert ours.kv[k] == v, k
        assert ours.kv_types[k][0] == ref.fields[k].types[0]
    ref_t = {t.name: t for t in ref.tensors}
    spec = ModelSpec.from_gguf(path)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t in ours.tensors:
        assert t.offset == ref_t[t.name].data_offset
        assert list(t.ne) == ref_t[t.name].shape.tolist()
        assert spec.tensors[t.name].nbytes == int(ref_t[t.name].n_bytes)
        assert np.array_equal(
            np.fromfile(path, np.uint8, count=spec.tensors[t.name].nbytes, offset=t.offset),
            np.asarray(ref_t[t.name].data).view(np.uint8).reshape(-1),
        )


def test_strings_that_are_not_utf8(tmp_path: Path) -> None:
    """String values and string-array items whose bytes are not UTF-8 decode with U+FFFD by
    default and keep their bytes (as surrogate escapes) with ``strings="surrogateescape"``;
    keys and valid strings are the same either way."""
    path = tmp_path / "bytes.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("test.name", "caf\xe9")
    w.add_token_list([b"a", b"\xff\xfe", "\u0120x".encode(), b"\xe2\x82"])
    w.add_key_value("test.raw", b"\x80z", gguf.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = [b"a", b"\xff\xfe", "\u0120x".encode(), b"\xe2\x82"]
    plain = read_header(path)
    kept = read_header(path, strings="surrogateescape")
    assert set(plain.kv) == set(kept.kv)
    assert plain.kv["tokenizer.ggml.tokens"] == [b.decode("utf-8", "replace") for b in raw]
    assert [t.encode("utf-8", "surrogateescape") for t in kept.kv["tokenizer.ggml.tokens"]] == raw
    assert plain.kv["test.raw"] == "\ufffdz"
    assert kept.kv["test.raw"].encode("utf-8", "surrogateescape") == b"\x80z"
    assert plain.kv["test.name"] == kept.kv["test.name"] == "caf\xe9"
