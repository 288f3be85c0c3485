"""GGUF metadata is bounded where it is read: every key the model reader reads, given a hostile
value, ends in one `LayoutError` naming the problem, or in a spec the engine can load; never
another exception, never a hang."""

from __future__ import annotations

import math
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estream_layout import (
    ARCHES,
    InvalidGGUFError,
    InvalidMetadataError,
    LayoutError,
    ModelSpec,
    pack_model,
    synth_model,
    verify_pack,
)
from estream_layout.gguf_header import read_header
from estream_layout.gguf_model import _tensor_infos
from estream_layout.testing import DROP, mutate_gguf

A = "olmoe."


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("olmoe", "tiny", tmp_path_factory.mktemp("meta") / "a.gguf", seed=1)


def _refused(src: Path, tmp_path: Path, **kw: Any) -> str:
    """Pack a mutated copy of `src`; the InvalidGGUFError message (nothing may be written)."""
    bad = mutate_gguf(src, tmp_path / "bad.gguf", **kw)
    with pytest.raises(InvalidGGUFError) as info:
        pack_model(bad, tmp_path / "bad.estream", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]
    return str(info.value)


@pytest.mark.parametrize(
    ("kv", "needle"),
    [
        ({A + "context_length": 1}, "context_length = 1 must be >= 16"),
        ({A + "context_length": DROP}, "context_length is missing"),
        ({A + "context_length": 2**40}, "context_length = 1099511627776 must be <= 16777216"),
        ({A + "feed_forward_length": 0}, "feed_forward_length = 0 must be >= 1"),
        ({"tokenizer.ggml.bos_token_id": 10**6}, "bos_token_id = 1000000 must be <= 300"),
        ({"tokenizer.ggml.eos_token_id": 301}, "eos_token_id = 301 must be <= 300"),
        ({"tokenizer.ggml.eos_token_id": -1}, "eos_token_id = -1 must be >= 0"),
        ({"tokenizer.ggml.add_bos_token": "no"}, "add_bos_token = 'no' is not true/false"),
        ({"tokenizer.ggml.tokens": ["a", "b"]}, "tokens has 2 tokens, but token_embd"),
        ({"tokenizer.ggml.scores": [0.5]}, "scores must be an array of one entry per token"),
        ({A + "vocab_size": 300}, "vocab_size = 300, but token_embd.weight has 301 rows"),
        ({A + "expert_count": 2**40}, "expert_count = 1099511627776 must be <= 65536"),
        ({A + "expert_count": 16}, r"expected \(16, 64, 64\)"),
        ({A + "expert_used_count": -3}, "expert_used_count = -3 must be >= 1"),
        ({A + "expert_used_count": 2.5}, "expert_used_count = 2.5 is not an integer"),
        ({A + "expert_used_count": float("nan")}, "expert_used_count = nan is not an integer"),
        ({A + "expert_used_count": [2, 9]}, "expert_used_count = 9 exceeds expert_count = 8"),
        ({A + "attention.head_count_kv": 2},
         r"attn_k\.weight has shape \[64, 64\], expected \[32, 64\]"),
        ({A + "attention.head_count_kv": 3}, "head_count_kv = 3 must divide head_count = 4"),
        ({A + "attention.head_count": 2**31}, "head_count = 2147483648 must be <= 16384"),
        ({A + "attention.value_length": 8}, r"attn_v.weight has shape \[64, 64\], expected \[32"),
        ({A + "attention.layer_norm_rms_epsilon": 5.0}, "rms_epsilon = 5 must be between"),
        ({A + "rope.freq_base": 1e309}, "freq_base = inf must be a finite number > 0"),
        ({A + "rope.freq_base": 1e300}, "freq_base = 1e[+]300 must be between 0 and 1e[+]12"),
        ({A + "rope.scaling.factor": -2.0}, "scaling.factor = -2 must be between 0 and 10000"),
        ({A + "rope.scaling.factor": "x"}, "scaling.factor = 'x' is not a number"),
        ({A + "rope.scaling.type": ["yarn"]}, r"scaling\.type = \['yarn'\] is not one of"),
        ({A + "leading_dense_block_count": 1}, "olmoe has no leading dense layers"),
        ({A + "leading_dense_block_count": 2**40}, "leading_dense_block_count = 1099511627776"),
        ({A + "expert_shared_count": 9}, "expert_shared_count = 9 must be <= 8"),
        ({"general.alignment": 0}, "general.alignment 0 is not a power of two"),
        ({"general.alignment": 48}, "general.alignment 48 is not a power of two"),
    ],
)  # fmt: skip
def test_nonsense_metadata_is_refused_naming_the_key(
    olmoe: Path, tmp_path: Path, kv: dict[str, Any], needle: str
) -> None:
    """Values that are out of range, of the wrong type, or inconsistent with the tensors are
    refused at pack time with an InvalidGGUFError naming the key or tensor."""
    import re

    msg = _refused(olmoe, tmp_path, set_kv=kv)
    assert re.search(needle, msg), msg


def test_block_count_beyond_the_tensors_fails_fast(olmoe: Path, tmp_path: Path) -> None:
    """block_count 2**31 (and any count the tensors do not have) is refused in well under a
    second: nothing is sized by the count before it is checked against the tensors."""
    for count in (2**31, 2**32 - 1, 4096, 3):
        bad = mutate_gguf(olmoe, tmp_path / "bad.gguf", set_kv={A + "block_count": count})
        t0 = time.monotonic()
        with pytest.raises(InvalidMetadataError, match=rf"block_count = {count}"):
            ModelSpec.from_gguf(bad)
        assert time.monotonic() - t0 < 1.0


def test_block_count_of_a_corrupt_array_fails_fast(olmoe: Path, tmp_path: Path) -> None:
    """A per-layer key sized by block_count does not get the chance to allocate for it."""
    bad = mutate_gguf(olmoe, tmp_path / "bad.gguf", set_kv={A + "block_count": 2**62})
    t0 = time.monotonic()
    with pytest.raises(InvalidMetadataError, match="must be <= 4096"):
        ModelSpec.from_gguf(bad)
    assert time.monotonic() - t0 < 1.0


def _rename_in_header(path: Path, old: str, new: str) -> None:
    """Rename a tensor in place in the header (same length, so nothing else moves)."""
    assert len(old) == len(new)
    raw = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(old)) + old.encode()
    at = raw.index(key)
    raw[at : at + len(key)] = struct.pack("<Q", len(new)) + new.encode()
    path.write_bytes(bytes(raw))


def test_two_tensors_with_one_name_are_refused(olmoe: Path, tmp_path: Path) -> None:
    """A tensor index naming one tensor twice (the second would shadow the first) is refused."""
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(olmoe, bad)
    _rename_in_header(bad, "blk.0.attn_k.weight", "blk.0.attn_q.weight")
    with pytest.raises(InvalidGGUFError, match=r"tensor blk\.0\.attn_q\.weight appears twice"):
        pack_model(bad, tmp_path / "x.estream", progress=False)


def test_a_missing_tensor_the_family_needs_is_refused(olmoe: Path, tmp_path: Path) -> None:
    """A tensor the engine builds a layer from (here attn_v, renamed to something it does not
    read) is missing: refused at pack time, naming it."""
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(olmoe, bad)
    _rename_in_header(bad, "blk.1.attn_v.weight", "blk.1.attn_x.weight")
    with pytest.raises(InvalidGGUFError, match=r"tensor blk\.1\.attn_v\.weight is missing"):
        pack_model(bad, tmp_path / "x.estream", progress=False)


def test_a_metadata_key_twice_is_refused(olmoe: Path, tmp_path: Path) -> None:
    """Two values for one key (which one a reader sees depends on the reader) are refused."""
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(olmoe, bad)
    _rename_in_header(bad, "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    with pytest.raises(InvalidGGUFError, match=r"'tokenizer\.ggml\.eos_token_id' appears twice"):
        ModelSpec.from_gguf(bad)


# ------------------------------------------------------------------------------ property test
class _Recording(dict):  # type: ignore[type-arg]
    """A metadata mapping that records every key looked up."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


@pytest.fixture(scope="module")
def readers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict, dict, list]]:
    """Per architecture: the tiny model, its metadata, its tensors and every metadata key the
    model reader looks up (present or not), recorded on a valid model."""
    d = tmp_path_factory.mktemp("readers")
    out = {}
    for arch in ARCHES:
        path = synth_model(arch, "tiny", d / f"{arch}.gguf", seed=2)
        header = read_header(path)
        tensors = _tensor_infos(path, header)
        rec = _Recording(header.kv)
        ModelSpec._from_fields(path, rec, tensors)
        keys = sorted(rec.read | set(header.kv))
        out[arch] = (path, dict(header.kv), tensors, keys)
    return out


def test_the_recorded_keys_cover_the_family_keys(readers: dict) -> None:
    """The property test draws from what the reader actually reads: the per-family keys and
    the absent optional ones must be among them (else the test would cover less than it says)."""
    keys = readers["deepseek2"][3]
    for k in ("deepseek2.block_count", "deepseek2.expert_shared_count",
              "deepseek2.attention.q_lora_rank", "deepseek2.rope.scaling.factor",
              "deepseek2.expert_group_count", "tokenizer.ggml.bos_token_id",
              "deepseek2.expert_gating_func", "deepseek2.attention.kv_lora_rank"):  # fmt: skip
        assert k in keys, k
    assert "lfm2moe.shortconv.l_cache" in readers["lfm2moe"][3]


_HOSTILE = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2, 3, 7, 8, 9, 16, 31, 32, 33, 64, 300, 301, 2**31, 2**32 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e309, -0.0, 0.5, 1e-30, 1e30]),
    st.booleans(),
    st.text(max_size=8),
    st.lists(st.integers(-5, 2**33), max_size=6),
    st.lists(st.text(max_size=3), max_size=3),
    st.just(DROP),
)


def _apply(fields: dict, changes: dict) -> dict:
    out = dict(fields)
    for k, v in changes.items():
        if v is DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("arch", ARCHES)
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_metadata_is_a_clean_error_or_a_loadable_spec(
    readers: dict, arch: str, data: st.DataObject
) -> None:
    """Any value (negative, zero, huge, NaN, infinite, wrong type, missing) for one to three of
    the keys the reader reads: either a LayoutError (what `estream-pack` reports as one line)
    or a spec that the engine's own reader (`ModelSpec.from_dict` of its summary) accepts; in
    well under a second either way."""
    path, fields, tensors, keys = readers[arch]
    chosen = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True))
    changes = {k: data.draw(_HOSTILE, label=k) for k in chosen}
    t0 = time.monotonic()
    try:
        spec = ModelSpec._from_fields(path, _apply(fields, changes), tensors)
    except LayoutError as e:
        assert "\n" not in str(e)
    else:
        ModelSpec.from_dict(spec.summary())
    assert time.monotonic() - t0 < 2.0, changes


def _gguf_safe(v: Any) -> bool:
    """Values mutate_gguf can write (GGUF arrays hold one type; integers up to 64 bits)."""
    if isinstance(v, list):
        return bool(v) and all(_gguf_safe(x) for x in v) and len({type(x) for x in v}) <= 1
    return not isinstance(v, int) or isinstance(v, bool) or -(2**63) <= v < 2**64


def _cases(readers: dict) -> Iterator[tuple[str, str, Any]]:
    vals = [0, -1, 2**31, 2**63, 1.5, math.nan, math.inf, "x", [], [1, 2], True]
    for arch in ("olmoe", "deepseek2", "lfm2moe"):
        keys = readers[arch][3]
        for i, key in enumerate(keys):
            if key == "general.architecture":
                continue
            yield arch, key, vals[i % len(vals)]


def test_hostile_metadata_through_the_cli_is_one_line_or_a_valid_pack(
    readers: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end, file to pack: each key the reader reads, given a hostile value, makes
    `estream-pack` exit 2 with one line (no traceback, nothing left behind) or write a pack
    that verifies."""
    from estream_layout.cli import pack_main

    outcomes = {"refused": 0, "packed": 0}
    for arch, key, value in _cases(readers):
        if not _gguf_safe(value):
            continue
        src = mutate_gguf(readers[arch][0], tmp_path / "src.gguf", set_kv={key: value})
        dst = tmp_path / "out.estream"
        t0 = time.monotonic()
        rc = pack_main([str(src), "-o", str(dst), "--no-progress"])
        assert time.monotonic() - t0 < 30
        err = capsys.readouterr().err
        assert "Traceback" not in err, (arch, key, value, err)
        if rc == 0:
            assert verify_pack(dst).ok, (arch, key, value)
            shutil.rmtree(dst)
            outcomes["packed"] += 1
        else:
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1, (arch, key, value, err)
            assert lines[0].startswith("estream-pack: error: "), lines
            outcomes["refused"] += 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"], (arch, key)
    assert outcomes["refused"] > 20 and outcomes["packed"] > 5, outcomes
