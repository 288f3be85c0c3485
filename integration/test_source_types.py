"""A GGUF computed as it is: expert tensors stored as Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL,
Q4_1, Q5_0, Q5_1 or IQ4_XS (every projection, or mixed per projection as quantizer mixes such as
Q4_K_M write them) are packed without re-quantization, the manifest records each projection's
format, and the engine runs those tiles in every mode and on every backend. Dense matrices
stored as F32, F16 or BF16 are kept as they are too (`f32`, `f16-t32r4`, `bf16-t32r4`) and
multiplied in fp32.

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


KQ_DIMS = {"n_embd": 256, "n_ff_exp": 256}  # K-quant rows: whole 256-value super-blocks


@pytest.fixture(
    scope="module",
    params=[
        "all-q8_0",
        "down-q8_0",
        "q4_k_m",
        "all-q6_k",
        "q4_k_m-dense",
        "q5_k_m",
        "mxfp4",
        "mxfp4-dense",
        "iq4_nl",
        "q5_0",
        "iq4_xs",
    ],
)
def packed(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"types-{request.param}")
    if request.param == "all-q8_0":
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=5, expert_type="Q8_0")
        want = ("q8_0-t32r4",) * 3
    elif request.param == "q4_k_m":  # Q4_K_M's experts: Q4_K gate/up, Q6_K down
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=5, expert_type="Q4_K",
                          expert_down_type="Q6_K", dims=KQ_DIMS)  # fmt: skip
        want = ("q4_k-t32r4", "q4_k-t32r4", "q6_k-t32r4")
    elif request.param == "q4_k_m-dense":  # and the dense part too: Q4_K matrices, Q6_K head
        dims = {**KQ_DIMS, "n_head": 4, "head_dim": 64, "n_ff": 256}
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=7, expert_type="Q4_K",
                          expert_down_type="Q6_K", dense_type="Q4_K", output_type="Q6_K",
                          dims=dims)  # fmt: skip
        want = ("q4_k-t32r4", "q4_k-t32r4", "q6_k-t32r4")
    elif request.param == "q5_k_m":  # Q5_K_M's experts: Q5_K gate/up, Q6_K down; Q5_K dense
        dims = {**KQ_DIMS, "n_head": 4, "head_dim": 64, "n_ff": 256}
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=10, expert_type="Q5_K",
                          expert_down_type="Q6_K", dense_type="Q5_K", dims=dims)  # fmt: skip
        want = ("q5_k-t32r4", "q5_k-t32r4", "q6_k-t32r4")
    elif request.param == "mxfp4":  # gpt-oss's expert type
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=8, expert_type="MXFP4")
        want = ("mxfp4-t32r4",) * 3
    elif request.param == "mxfp4-dense":  # MXFP4 dense matrices and embedding, Q8_0 down
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=9, expert_type="MXFP4",
                          expert_down_type="Q8_0", dense_type="MXFP4")  # fmt: skip
        want = ("mxfp4-t32r4", "mxfp4-t32r4", "q8_0-t32r4")
    elif request.param == "iq4_nl":  # IQ4_NL experts and dense matrices
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=11, expert_type="IQ4_NL",
                          dense_type="IQ4_NL")  # fmt: skip
        want = ("iq4_nl-t32r4",) * 3
    elif request.param == "q5_0":  # Q5_0 gate/up, Q5_1 down, Q4_1 dense matrices
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=13, expert_type="Q5_0",
                          expert_down_type="Q5_1", dense_type="Q4_1")  # fmt: skip
        want = ("q5_0-t32r4", "q5_0-t32r4", "q5_1-t32r4")
    elif request.param == "iq4_xs":  # IQ4_XS experts and dense matrices (published MoE files)
        dims = {**KQ_DIMS, "n_head": 4, "head_dim": 64, "n_ff": 256}
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=16, expert_type="IQ4_XS",
                          dense_type="IQ4_XS", dims=dims)  # fmt: skip
        want = ("iq4_xs-t32r4",) * 3
    elif request.param == "all-q6_k":
        src = synth_model("qwen3moe", "tiny", d / "m.gguf", seed=6, expert_type="Q6_K",
                          dims=KQ_DIMS)  # fmt: skip
        want = ("q6_k-t32r4",) * 3
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
    src, dst, want = packed
    doc = json.loads((dst / "manifest.json").read_text())
    assert doc["source"]["requantized"] is False and doc["source"]["requantized_tensors"] == []
    for la in doc["layers"]:
        got = tuple(la["projections"][j]["format"] for j in ("gate", "up", "down"))
        assert got == want, la["index"]
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(src).tensors}
    tiles = {"Q4_0": "q4_0-t32r4", "Q8_0": "q8_0-t32r4", "Q4_K": "q4_k-t32r4", "Q6_K": "q6_k-t32r4",
             "Q5_K": "q5_k-t32r4", "MXFP4": "mxfp4-t32r4", "IQ4_NL": "iq4_nl-t32r4",
             "Q4_1": "q4_1-t32r4", "Q5_0": "q5_0-t32r4", "Q5_1": "q5_1-t32r4",
             "IQ4_XS": "iq4_xs-t32r4"}  # fmt: skip
    for name, t in doc["dense"]["tensors"].items():  # quantized matrices keep their type too
        if t["format"] != "f32":
            assert t["format"] == tiles[kinds[name]], name


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
    Q8_0 / K-quant (and mixed) records and give the host's logits (within 1e-5: every kernel,
    attention and activation gives the host's bits, but rope and the router call the platform's
    libm, cos/sin/exp within a few ulp of each other). (The int8 path's distance to the float64 reference is
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


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_htp_and_layout_kquant_tiles_agree_with_gguf(qtype):
    """The two independent K-quant tile writers (estream-layout's packer, estream-htp's test
    packer) produce the same bytes, and estream-htp's own dequantization of the tiles (what its
    float64 references use) is gguf-py's dequantization of the source blocks bit for bit."""
    import estream_htp.testing as T
    from estream_layout import tiles

    rng = np.random.default_rng(9)
    n, k = 45, 512
    gen = T.random_q4_k_blocks if qtype == "Q4_K" else T.random_q6_k_blocks
    blocks = gen(rng, n, k).reshape(n, -1)
    fmt = "q4_k-t32r4" if qtype == "Q4_K" else "q6_k-t32r4"
    ours = tiles.pack_tiles(blocks, fmt)
    theirs = (T.pack_q4_k_t32r4 if qtype == "Q4_K" else T.pack_q6_k_t32r4)(blocks)
    assert np.array_equal(ours, theirs)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    got = T.dequantize_tiles(theirs, fmt, n, k)
    assert np.array_equal(np.asarray(got, np.float32).view(np.uint32), want.view(np.uint32))


def test_layers_of_different_types_run_as_stored(tmp_path):
    """A file whose layers store ffn_down in different types (as Q4_K_M does: Q6_K in some
    layers, Q4_K in the others): every layer's records have one shape (each projection padded
    to the largest), the manifest holds each layer's formats, and the engine runs each layer's
    experts in their own format — f32 within 1e-5 of the file's float64 reference in stream
    and resident mode, the host-process executor equal to the host on the int8 path."""
    from reference import reference_forward

    kw = {"seed": 5, "expert_type": "Q4_K", "dims": KQ_DIMS}
    a = synth_model("qwen3moe", "tiny", tmp_path / "a.gguf", **kw)
    b = synth_model("qwen3moe", "tiny", tmp_path / "b.gguf", expert_down_type="Q6_K", **kw)
    src = tmp_path / "m.gguf"
    reader, other = gguf.GGUFReader(a), gguf.GGUFReader(b)
    w = gguf.GGUFWriter(src, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    swap = "blk.1.ffn_down_exps.weight"
    for t in reader.tensors:
        t = next(o for o in other.tensors if o.name == swap) if t.name == swap else t
        data = np.asarray(t.data)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dst = tmp_path / "m.estream"
    pack_model(src, dst, progress=False)
    doc = json.loads((dst / "manifest.json").read_text())
    formats = [[la["projections"][j]["format"] for j in ("gate", "up", "down")]
               for la in doc["layers"]]  # fmt: skip
    assert formats == [["q4_k-t32r4"] * 3, ["q4_k-t32r4", "q4_k-t32r4", "q6_k-t32r4"]]
    assert len({la["record_bytes"] for la in doc["layers"]}) == 1
    toks = np.random.default_rng(3).integers(0, 200, size=29)
    ref = reference_forward(src, toks)
    for mode_kw in ({"mode": "resident"}, {"mode": "stream", "G": 2, "Q": 2, "B": 3}):
        with estream.load(dst, act="f32", **mode_kw) as eng:
            got = eng.prefill(toks, all_logits=True).logits
        assert rel_l2(got, ref) <= 1e-5, mode_kw
    stream = {"mode": "stream", "G": 2, "Q": 2, "B": 3}
    with estream.load(dst, backend="host", **stream) as eng:
        host = eng.prefill(toks, all_logits=True).logits
    with estream.load(dst, backend="host-process", **stream) as eng:
        other_be = eng.prefill(toks, all_logits=True).logits
    assert rel_l2(other_be, host) <= 1e-5


F32_DENSE_ARCHS = [
    "qwen3moe",
    "olmoe",
    "mixtral",
    "deepseek2",
    "lfm2moe",
    "gpt-oss",
    "smallthinker",
]


@pytest.fixture(scope="module", params=F32_DENSE_ARCHS)
def f32_dense(request, tmp_path_factory):
    """A file whose dense matrices (attention, MLA projections, shared experts, dense FFN layers,
    convolutions, token embedding) and output head are all F32, packed."""
    d = tmp_path_factory.mktemp(f"f32-dense-{request.param}")
    src = synth_model(request.param, "tiny", d / "m.gguf", seed=17, dense_type="F32",
                      output_type="F32")  # fmt: skip
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    return src, dst


def test_f32_dense_matrices_are_packed_and_computed_as_f32(f32_dense):
    """F32 dense matrices stay `f32` in the manifest (no re-quantization to Q8_0), and with fp32
    activations the logits equal the file's float64 reference to fp32 accumulation (1e-5), in
    resident and stream mode."""
    from reference import reference_forward

    src, dst = f32_dense
    doc = json.loads((dst / "manifest.json").read_text())
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(src).tensors}
    n_mat = 0
    for name, t in doc["dense"]["tensors"].items():
        if kinds[name] == "F32":
            assert t["format"] == "f32", name
            n_mat += len(t["shape"]) >= 2
    assert n_mat >= 4
    for name in ("token_embd.weight", "output.weight"):  # lfm2 ties its head to the embedding
        if name in kinds:
            assert doc["dense"]["tensors"][name]["format"] == "f32", name
    assert doc["source"]["requantized"] is False
    toks = np.random.default_rng(3).integers(0, 200, size=29)
    ref = reference_forward(src, toks)
    for kw in ({"mode": "resident"}, {"mode": "stream", "G": 2, "Q": 2, "B": 3}):
        with estream.load(dst, act="f32", **kw) as eng:
            got = eng.prefill(toks, all_logits=True).logits
        assert rel_l2(got, ref) <= 1e-5, kw
        assert np.array_equal(np.argmax(got, axis=1), np.argmax(ref, axis=1)), kw


@pytest.mark.parametrize(
    ("backend", "act"),
    [
        ("host-process", "q8"),
        ("host-process", "f32"),
        pytest.param(
            "hexagon",
            "f32",
            marks=pytest.mark.skipif(not _HEXAGON, reason="hexagon toolchain not installed"),
        ),
    ],
)
def test_f32_dense_matrices_on_every_backend_match_host(f32_dense, backend, act):
    """The f32 dense matrices (fp32 products under either activation setting) computed by the
    host-process and hexagon executors give the host's logits within 1e-5 (their kernel tables
    accumulate in another order). Hexagon runs the exact path only: its HVX fp32 sums differ from
    the host's by ~1e-7, and under int8 activations such a difference can flip one activation's
    rounding downstream (deepseek2: 1e-4)."""
    _, dst = f32_dense
    toks = np.random.default_rng(4).integers(0, 200, size=23)
    kw = {"mode": "stream", "G": 2, "Q": 2, "B": 3, "act": act}
    with estream.load(dst, backend="host", **kw) as eng:
        host = eng.prefill(toks, all_logits=True).logits
    with estream.load(dst, backend=backend, **kw) as eng:
        got = eng.prefill(toks, all_logits=True).logits
    assert np.isfinite(got).all()
    assert rel_l2(got, host) <= 1e-5


F16_DENSE_CASES = [
    (arch, dtype)
    for dtype in ("F16", "BF16")
    for arch in ("qwen3moe", "deepseek2", "lfm2moe", "gpt-oss")
]


@pytest.fixture(scope="module", params=F16_DENSE_CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def f16_dense(request, tmp_path_factory):
    """A file whose dense matrices (attention, MLA projections, shared experts, dense FFN layers,
    convolutions, token embedding) and output head are all F16 (or all BF16), packed."""
    arch, dtype = request.param
    d = tmp_path_factory.mktemp(f"{dtype.lower()}-dense-{arch}")
    src = synth_model(arch, "tiny", d / "m.gguf", seed=19, dense_type=dtype, output_type=dtype)
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    return src, dst, dtype


def test_f16_bf16_dense_matrices_are_packed_as_stored_and_computed_in_fp32(f16_dense):
    """F16 / BF16 dense matrices are packed as `f16-t32r4` / `bf16-t32r4` tiles (the manifest
    holds the source type; no re-quantization to Q8_0; matrices whose rows are not a multiple
    of 32, like LFM2's convolutions, stay f32), and with fp32 activations the logits equal the
    file's float64 reference to fp32 accumulation (1e-5), in resident and stream mode; under
    int8 activations they stay fp32 products and the logits stay finite."""
    from reference import reference_forward

    src, dst, dtype = f16_dense
    fmt = dtype.lower() + "-t32r4"
    doc = json.loads((dst / "manifest.json").read_text())
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(src).tensors}
    n_tiled = 0
    for name, t in doc["dense"]["tensors"].items():
        if kinds[name] == dtype and len(t["shape"]) >= 2:
            want = fmt if t["shape"][-1] % 32 == 0 else "f32"
            assert t["format"] == want, name
            n_tiled += want == fmt
    assert n_tiled >= 4
    assert doc["dense"]["tensors"]["token_embd.weight"]["format"] == fmt
    assert "q8_0-t32r4" not in {t["format"] for t in doc["dense"]["tensors"].values()}
    assert doc["source"]["requantized"] is False
    toks = np.random.default_rng(3).integers(0, 200, size=29)
    ref = reference_forward(src, toks)
    for kw in ({"mode": "resident"}, {"mode": "stream", "G": 2, "Q": 2, "B": 3}):
        with estream.load(dst, act="f32", **kw) as eng:
            got = eng.prefill(toks, all_logits=True).logits
        assert rel_l2(got, ref) <= 1e-5, kw
        assert np.array_equal(np.argmax(got, axis=1), np.argmax(ref, axis=1)), kw
    with estream.load(dst, act="q8", mode="resident") as eng:
        assert np.isfinite(eng.prefill(toks, all_logits=True).logits).all()


@pytest.mark.parametrize(
    ("backend", "act"),
    [
        ("host-process", "q8"),
        ("host-process", "f32"),
        pytest.param(
            "hexagon",
            "f32",
            marks=pytest.mark.skipif(not _HEXAGON, reason="hexagon toolchain not installed"),
        ),
    ],
)
def test_f16_bf16_dense_matrices_on_every_backend_match_host(f16_dense, backend, act):
    """The F16 / BF16 tiles (fp32 products under either activation setting) computed by the
    host-process and hexagon executors give the host's logits within 1e-5 (their kernel tables
    may accumulate in another order); the exact path only on hexagon, as for f32 matrices."""
    _, dst, _ = f16_dense
    toks = np.random.default_rng(4).integers(0, 200, size=23)
    kw = {"mode": "stream", "G": 2, "Q": 2, "B": 3, "act": act}
    with estream.load(dst, backend="host", **kw) as eng:
        host = eng.prefill(toks, all_logits=True).logits
    with estream.load(dst, backend=backend, **kw) as eng:
        got = eng.prefill(toks, all_logits=True).logits
    assert np.isfinite(got).all()
    assert rel_l2(got, host) <= 1e-5
