"""The contracts of docs/contracts.md, checked across the packages that must agree on them."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import estream_arena as ea
import estream_htp as htp
import estream_layout as el
from estream_htp.testing import pack_f16_t32r4
from estream_layout import pack_model, synth_model


def _blocks(rng: np.random.Generator, n: int, k: int, fmt: str) -> np.ndarray:
    size = 18 if fmt == "q4_0-t32r4" else 34
    raw = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    raw[..., :2] = scales.view(np.uint8).reshape(n, k // 32, 2)
    return raw


# -- §1 tile formats: layout writes, htp reads -----------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 100),
    kb=st.integers(1, 6),
    fmt=st.sampled_from(["q4_0-t32r4", "q8_0-t32r4"]),
    seed=st.integers(0, 2**31),
)
def test_layout_and_htp_write_identical_tiles(n, kb, fmt, seed):
    k = 32 * kb
    b = _blocks(np.random.default_rng(seed), n, k, fmt)
    ours = el.pack_tiles(b.reshape(n, -1), fmt)
    theirs = htp.pack_q4_0_t32r4(b) if fmt == "q4_0-t32r4" else htp.pack_q8_0_t32r4(b)
    assert ours.nbytes == el.tile_nbytes(n, k, fmt)
    np.testing.assert_array_equal(np.asarray(ours).ravel(), np.asarray(theirs).ravel())


@pytest.mark.parametrize("fmt", ["q4_0-t32r4", "q8_0-t32r4"])
@pytest.mark.parametrize(("t", "n", "k"), [(1, 33, 64), (7, 96, 160), (19, 50, 96)])
def test_htp_gemm_on_layout_tiles_matches_layout_dequantization(fmt, t, n, k):
    rng = np.random.default_rng(n * k + t)
    w = el.pack_tiles(_blocks(rng, n, k, fmt).reshape(n, -1), fmt)
    x = rng.standard_normal((t, k)).astype(np.float32)
    ref = x.astype(np.float64) @ el.dequantize_tiles(w, n, k, fmt).astype(np.float64).T
    htp.set_activation_format("f32")
    try:
        out = np.full((t, n), np.nan, dtype=np.float32)
        got = htp.gemm(x, w, n, fmt, out=out)
    finally:
        htp.set_activation_format("q8")
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-5


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 100),
    kb=st.integers(1, 4),
    fmt=st.sampled_from(["f16-t32r4", "bf16-t32r4"]),
    seed=st.integers(0, 2**31),
)
def test_layout_and_htp_agree_on_float16_tiles(n, kb, fmt, seed):
    """F16 / BF16 dense tiles: the layout package and estream-htp lay the same 16-bit values
    out byte for byte and read them as the same fp32 values, and htp's GEMM on layout's tiles
    (fp32 under either act) equals the float64 product of layout's dequantization to 1e-5."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    v = rng.standard_normal((n, k)).astype(np.float32)
    u = v.astype(np.float16).view(np.uint16) if fmt == "f16-t32r4" else v.view("<u4") >> 16
    u = u.astype(np.uint16)
    ours = el.pack_tiles(u.view(np.uint8).reshape(n, -1), fmt)
    theirs = pack_f16_t32r4(u)
    np.testing.assert_array_equal(np.asarray(ours).ravel(), np.asarray(theirs).ravel())
    w = el.dequantize_tiles(ours, n, k, fmt)
    assert np.array_equal(w.view(np.uint32), htp.dequantize_tiles(ours, fmt, n, k).view(np.uint32))
    x = rng.standard_normal((3, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    for act in ("q8", "f32"):
        got = htp.gemm(x, ours, n, fmt, out=np.full((3, n), np.nan, np.float32), act=act)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-5, act


# -- §2–§4 records, checksums, arena planes, the expert op ------------------------------------
@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    src = d / "m.gguf"
    synth_model("qwen3moe", "tiny", src, seed=2)
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    return src, dst, json.loads((dst / "manifest.json").read_text())


def test_records_hold_the_source_experts_and_their_checksums(pack):
    src, dst, man = pack
    spec = el.ModelSpec.from_gguf(src)
    pool = np.fromfile(dst / "experts.bin", dtype=np.uint8)
    for lay in man["layers"]:
        rb = lay["record_bytes"]
        assert lay["offset"] % 4096 == 0 and rb % 4096 == 0
        for p, e in enumerate(lay["order"]):
            rec = pool[lay["offset"] + p * rb : lay["offset"] + (p + 1) * rb]
            assert zlib.crc32(rec) == lay["checksums"][p]
            for proj, name in (
                ("gate", "ffn_gate_exps"),
                ("up", "ffn_up_exps"),
                ("down", "ffn_down_exps"),
            ):
                pj = lay["projections"][proj]
                assert pj["offset_in_record"] % 4096 == 0 and pj["padded_bytes"] % 4096 == 0
                tiles = rec[pj["offset_in_record"] : pj["offset_in_record"] + pj["bytes"]]
                blocks = el.unpack_tiles(tiles, pj["rows"], pj["cols"])
                source = el.tensor_memmap(spec, f"blk.{lay['index']}.{name}.weight")[e]
                np.testing.assert_array_equal(blocks, np.asarray(source).reshape(blocks.shape))


def test_arena_loads_records_and_the_expert_op_reads_them(pack):
    """Records read by the arena into its planes give the same expert-op result as the records
    in place in experts.bin (resident addressing with stride = record_bytes)."""
    _, dst, man = pack
    lay = man["layers"][0]
    pj = lay["projections"]
    E = lay["n_experts"]
    d, ff = pj["gate"]["cols"], pj["gate"]["rows"]
    layout = ea.RecordLayout(
        record_bytes=lay["record_bytes"],
        planes=tuple(
            (pj[p]["offset_in_record"], pj[p]["padded_bytes"]) for p in ("gate", "up", "down")
        ),
    )
    rng = np.random.default_rng(0)
    T = 13
    x = rng.standard_normal((T, d)).astype(np.float32)
    experts = rng.integers(0, E, size=T * 2).astype(np.int32)
    tokens = np.repeat(np.arange(T, dtype=np.int32), 2)
    weights = rng.random(T * 2).astype(np.float32)
    order = np.asarray(lay["order"])
    position = np.empty_like(order)
    position[order] = np.arange(E)
    pool = np.fromfile(dst / "experts.bin", dtype=np.uint8)
    base = pool.ctypes.data + lay["offset"]
    htp.set_activation_format("f32")
    graph = htp.ExpertGraph(d, ff, 64, T)
    try:
        want = np.zeros((T, d), dtype=np.float32)
        planes = tuple(base + pj[p]["offset_in_record"] for p in ("gate", "up", "down"))
        graph.run(x, tokens, experts, weights, position.astype(np.int32), planes,
                  (lay["record_bytes"],) * 3, want)  # fmt: skip
        G = 3
        got = np.zeros((T, d), dtype=np.float32)
        with (
            ea.Arena(layout, n_banks=2, group_size=G) as arena,
            ea.GroupLoader(arena, dst / "experts.bin", 2, verify=True) as loader,
        ):
            loader.begin_layer(0)
            n_groups = -(-E // G)
            loader.submit(
                [
                    ea.GroupRequest(
                        k, lay["offset"] + k * G * lay["record_bytes"], min(G, E - k * G),
                        tuple(lay["checksums"][k * G : k * G + min(G, E - k * G)]),
                    )
                    for k in range(n_groups)
                ]
            )  # fmt: skip
            for k in range(n_groups):
                bank = loader.acquire(k, timeout=30)
                slot = np.full(E, -1, dtype=np.int32)
                slot[order[k * G : k * G + bank.n_records]] = np.asarray(bank.slots)
                sel = (position[experts] // G) == k
                planes = tuple(arena.plane_address(j) for j in range(3))
                strides = tuple(pj[p]["padded_bytes"] for p in ("gate", "up", "down"))
                graph.run(x, tokens[sel], experts[sel], weights[sel], slot, planes, strides, got)
                loader.release(bank)
            loader.end_layer()
    finally:
        graph.close()
        htp.set_activation_format("q8")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-6


def test_altered_record_fails_checksum_in_the_arena(pack, tmp_path):
    _, dst, man = pack
    lay = man["layers"][-1]
    bad = tmp_path / "experts.bin"
    data = bytearray((dst / "experts.bin").read_bytes())
    at = lay["offset"] + lay["record_bytes"] + 100  # inside storage position 1
    data[at] ^= 0xFF
    bad.write_bytes(bytes(data))
    pj = lay["projections"]
    layout = ea.RecordLayout(
        record_bytes=lay["record_bytes"],
        planes=tuple(
            (pj[p]["offset_in_record"], pj[p]["padded_bytes"]) for p in ("gate", "up", "down")
        ),
    )
    with (
        ea.Arena(layout, n_banks=1, group_size=2) as arena,
        ea.GroupLoader(arena, bad, 1, verify=True) as loader,
    ):
        loader.begin_layer(lay["index"])
        loader.submit([ea.GroupRequest(0, lay["offset"], 2, tuple(lay["checksums"][:2]))])
        with pytest.raises(ea.ChecksumError) as err:
            loader.acquire(0, timeout=30)
        assert err.value.group == 0 and err.value.layer == lay["index"]
