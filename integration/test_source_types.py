"""A GGUF computed as it is: expert tensors stored as Q8_0 (every projection, or only some, as
quantizer mixes write them) are packed without re-quantization, the manifest records each
projection's format, and the engine runs those tiles in every mode and on every backend.

``act="f32"`` is the exact path: the logits match the float64 reference of the source file
(which dequantizes the file's own blocks) to fp32 accumulation; the int8 path and the other
backends agree with it."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

import estream
from estream_htp import _hexagon
from estream_layout import pack_model, synth_model

_HEXAGON = not _hexagon.missing_tools() or (
    os.environ.get("ESTREAM_HTP_REQUIRE_HEXAGON", "").strip() == "1"
)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _down_as_q8_0(src, dst):
    """A copy of `src` whose every `ffn_down_exps` is Q8_0 (gate/up stay Q4_0): the shape of a
    quantizer mix that gives down projections a wider type."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name.endswith("ffn_down_exps.weight"):
            f = gguf.quants.dequantize(data, t.tensor_type)
            data = gguf.quants.quantize(f, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(
                t.name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module", params=["all-q8_0", "down-q8_0"])
def packed(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"types-{request.param}")
    if request.param == "all-q8_0":
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=5, expert_type="Q8_0")
        want = ("q8_0-t32r4",) * 3
    else:
        base = synth_model("qwen3moe", "tiny", d / "base.gguf", seed=5)
        src = _down_as_q8_0(base, d / "m.gguf")
        want = ("q4_0-t32r4", "q4_0-t32r4", "q8_0-t32r4")
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    return src, dst, want


def test_manifest_records_each_projection_format(packed):
    """The manifest holds the source's types: no re-quantization, each projection's tile
    format as the file stores that tensor."""
    _, dst, want = packed
    doc = json.loads((dst / "manifest.json").read_text())
    assert doc["source"]["requantized"] is False and doc["source"]["requantized_tensors"] == []
    for la in doc["layers"]:
        got = tuple(la["projections"][j]["format"] for j in ("gate", "up", "down"))
        assert got == want, la["index"]


def test_f32_matches_the_float64_reference_of_the_file(packed):
    """fp32 activations, stream and resident: the logits equal the float64 reference computed
    from the file's own blocks, to fp32 accumulation (1e-5), with the same top-1 everywhere."""
    from reference import reference_forward

    src, dst, _ = packed
    toks = np.random.default_rng(3).integers(0, 200, size=29)
    ref = reference_forward(src, toks)
    for kw in ({"mode": "resident"}, {"mode": "stream", "G": 2, "Q": 2, "B": 3}):
        with estream.load(dst, act="f32", **kw) as eng:
            got = eng.prefill(toks, all_logits=True).logits
        assert rel_l2(got, ref) <= 1e-5, kw
        assert np.array_equal(np.argmax(got, axis=1), np.argmax(ref, axis=1)), kw


@pytest.mark.parametrize(
    "backend",
    [
        "host-process",
        pytest.param(
            "hexagon",
            marks=pytest.mark.skipif(not _HEXAGON, reason="hexagon toolchain not installed"),
        ),
    ],
)
def test_int8_path_on_every_backend_matches_host(packed, backend):
    """The int8 path in stream mode: the host-process and hexagon executors compute the
    Q8_0 (and mixed) records and give the host's logits (within 1e-5: the executors' kernel
    tables accumulate in another order). (The int8 path's distance to the float64 reference is
    the activation format's, checked per op in estream-htp and per model in test_engine.)"""
    _, dst, _ = packed
    toks = np.random.default_rng(4).integers(0, 200, size=23)
    kw = {"mode": "stream", "G": 2, "Q": 2, "B": 3}
    with estream.load(dst, backend="host", **kw) as eng:
        host = eng.prefill(toks, all_logits=True).logits
    with estream.load(dst, backend=backend, **kw) as eng:
        got = eng.prefill(toks, all_logits=True).logits
    assert np.isfinite(got).all()
    assert rel_l2(got, host) <= 1e-5
