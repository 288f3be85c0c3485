"""The synthetic Hugging Face checkpoints parity feeds to llama.cpp's converter
(``integration/bench/hf_checkpoint.py``): the gpt-oss and SmallThinker layouts, checked without
the converter — config.json fields the converter and transformers read, tensor names the
converter's name tables map (gguf-py, llama.cpp's own), shapes as published, and the MXFP4
blocks decoding to the same weights as the F32 checkpoint."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest

from estream_layout import synth_dims

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from hf_checkpoint import (
    FP4_E2M1,
    mxfp4_pack,
    mxfp4_unpack,
    save_safetensors,
    write_checkpoint,
)


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A minimal safetensors reader (F32 and U8), independent of the writer."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    dtypes = {"F32": "<f4", "U8": "u1"}
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(body[a:b], dtype=dtypes[h["dtype"]]).reshape(h["shape"])
    return out


def _dims(arch: str, **kw: int) -> object:
    return attrs.evolve(synth_dims(arch, "tiny"), n_ff_exp=64, **kw)


def test_mxfp4_pack_puts_the_even_element_in_the_low_nibble() -> None:
    """Hugging Face's MXFP4 byte holds element 2j in its low nibble and 2j+1 in its high one;
    a block whose largest magnitude is 6 has exponent 0 (scale byte 127)."""
    row = np.zeros(32, dtype=np.float32)
    row[:4] = [0.5, -1.0, 6.0, 3.0]  # codes 1, 10, 7, 5
    blocks, scales = mxfp4_pack(row[None, :])
    assert scales.tolist() == [[127]]
    assert blocks[0, 0, 0] == 1 | (10 << 4) and blocks[0, 0, 1] == 7 | (5 << 4)
    assert not blocks[0, 0, 2:].any()


def test_mxfp4_round_trip_is_the_nearest_code_at_the_smallest_fitting_scale() -> None:
    """Unpacking gives, per element, the FP4 value nearest to it at the block's scale, and the
    scale is the smallest power of two that keeps the block's largest magnitude within 6."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 7, 96), dtype=np.float32) * np.float32(0.3)
    blocks, scales = mxfp4_pack(w)
    assert blocks.shape == (3, 7, 3, 16) and scales.shape == (3, 7, 3)
    back = mxfp4_unpack(blocks, scales)
    step = np.exp2(scales.astype(np.float64) - 127).repeat(32, axis=-1)
    grid = np.unique(np.abs(FP4_E2M1))
    scaled = np.abs(w) / step
    best = np.abs(scaled[..., None] - grid).min(axis=-1)
    assert np.allclose(np.abs(back - w) / step, best, atol=1e-6)
    amax = np.abs(w).reshape(3, 7, 3, 32).max(axis=-1)
    e = scales.astype(np.float64) - 127
    assert (amax <= 6 * np.exp2(e)).all() and (amax > 6 * np.exp2(e - 1)).all()


def test_safetensors_keeps_bytes_as_u8(tmp_path: Path) -> None:
    """uint8 arrays are stored as U8 and floats as F32, both read back exactly."""
    t = {"a": np.arange(12, dtype=np.uint8).reshape(3, 4), "b": np.linspace(0, 1, 5)}
    save_safetensors(tmp_path / "m.safetensors", t)
    back = load_safetensors(tmp_path / "m.safetensors")
    assert back["a"].dtype == np.uint8 and (back["a"] == t["a"]).all()
    assert back["b"].dtype == np.float32 and np.array_equal(back["b"], t["b"].astype(np.float32))


def _mapped(arch: gguf.MODEL_ARCH, n_layers: int, names: list[str]) -> dict[str, str]:
    """HF name -> GGUF name through the converter's tables; unmapped names map to ''."""
    tmap = gguf.get_tensor_name_map(arch, n_layers)
    out = {}
    for name in names:
        base, _, suffix = name.rpartition(".")
        if suffix in ("weight", "bias"):
            got = tmap.get_name(base)
            out[name] = f"{got}.{suffix}" if got else ""
        else:
            out[name] = tmap.get_name(name) or ""
    return out


def test_gpt_oss_checkpoint_is_the_published_layout(tmp_path: Path) -> None:
    """gpt-oss: config.json has the fields the converter reads (sliding_window, head_dim,
    num_local_experts, intermediate_size = the expert width, YaRN rope_scaling), the even
    layers slide; the tensors have openai/gpt-oss-20b's names and [E, in, out] expert shapes,
    and every non-expert tensor maps to the GGUF name llama.cpp's gpt-oss graph loads."""
    d = _dims("gpt-oss")
    out = write_checkpoint("gpt-oss", d, tmp_path / "ck", seed=1)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["model_type"] == "gpt_oss"
    assert cfg["sliding_window"] == d.sliding_window and cfg["head_dim"] == d.head_dim
    assert cfg["num_local_experts"] == d.n_experts and cfg["intermediate_size"] == 64
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    rs = cfg["rope_scaling"]
    assert (rs["rope_type"], rs["factor"]) == ("yarn", d.yarn_factor)
    assert rs["original_max_position_embeddings"] == d.yarn_orig_ctx
    assert "quantization_config" not in cfg
    t = load_safetensors(out / "model.safetensors")
    E, ne = d.n_experts, d.n_embd
    p = "model.layers.0."
    assert t[p + "mlp.experts.gate_up_proj"].shape == (E, ne, 128)
    assert t[p + "mlp.experts.down_proj"].shape == (E, 64, ne)
    assert t[p + "mlp.experts.gate_up_proj_bias"].shape == (E, 128)
    assert t[p + "self_attn.sinks"].shape == (d.n_head,)
    plain = [n for n in t if ".mlp.experts." not in n]
    # the converter appends ".weight" to the sinks before mapping
    mapped = _mapped(
        gguf.MODEL_ARCH.GPT_OSS,
        d.n_layers,
        [n + ".weight" if n.endswith("sinks") else n for n in plain],
    )
    assert all(mapped.values()), [k for k, v in mapped.items() if not v]
    assert mapped[p + "post_attention_layernorm.weight"] == "blk.0.post_attention_norm.weight"
    assert mapped[p + "mlp.router.bias"] == "blk.0.ffn_gate_inp.bias"
    assert mapped[p + "self_attn.sinks.weight"] == "blk.0.attn_sinks.weight"


def test_gpt_oss_mxfp4_checkpoint_holds_the_f32_checkpoints_weights(tmp_path: Path) -> None:
    """With ``mxfp4``: quantization_config says mxfp4, the experts come as *_blocks/*_scales
    ([E, out, in/32, 16] / [E, out, in/32]) in place of the float tensors, and they decode to
    the F32 checkpoint's experts (same seed) within MXFP4's rounding; every other tensor is
    identical."""
    d = _dims("gpt-oss")
    f32 = load_safetensors(
        write_checkpoint("gpt-oss", d, tmp_path / "a", seed=4) / "model.safetensors"
    )
    out = write_checkpoint("gpt-oss", d, tmp_path / "b", seed=4, mxfp4=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    mx = load_safetensors(out / "model.safetensors")
    for name in set(f32) - {n for n in f32 if n.endswith(("gate_up_proj", "down_proj"))}:
        assert np.array_equal(mx[name], f32[name]), name
    for i in range(d.n_layers):
        p = f"model.layers.{i}.mlp.experts."
        assert p + "gate_up_proj" not in mx and p + "down_proj" not in mx
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = mx[p + proj + "_blocks"], mx[p + proj + "_scales"]
            assert blocks.dtype == np.uint8 and scales.dtype == np.uint8
            want = f32[p + proj].transpose(0, 2, 1)  # [E, out, in]
            assert blocks.shape == (*want.shape[:2], want.shape[2] // 32, 16)
            got = mxfp4_unpack(blocks, scales)
            # within half the widest FP4 step (2) at the block's scale
            tol = np.exp2(scales.astype(np.float64) - 127).repeat(32, axis=-1)
            assert (np.abs(got - want) <= tol + 1e-7).all()
            assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.98


def test_mxfp4_is_gpt_oss_only(tmp_path: Path) -> None:
    """Asking for MXFP4 experts of another family is refused before anything is written."""
    with pytest.raises(ValueError, match="only gpt-oss"):
        write_checkpoint("smallthinker", _dims("smallthinker"), tmp_path / "x", mxfp4=True)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("window", [0, 4096])
def test_smallthinker_checkpoint_is_the_published_layout(tmp_path: Path, window: int) -> None:
    """SmallThinker: config.json has the moe_* fields the converter reads (expert count, top-k,
    width, softmax flag from the gating), a window on layers i % 4 != 0 with NoPE on the others
    when a window is asked for and none otherwise; per-expert gate/up/down tensors, and every
    tensor maps to llama.cpp's smallthinker names (the experts once merged)."""
    d = _dims("smallthinker", sliding_window=window)
    out = write_checkpoint("smallthinker", d, tmp_path / "ck", seed=2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["SmallThinkerForCausalLM"]
    assert cfg["moe_num_primary_experts"] == d.n_experts
    assert cfg["moe_num_active_primary_experts"] == d.n_experts_used
    assert cfg["moe_ffn_hidden_size"] == 64
    assert cfg["moe_primary_router_apply_softmax"] is (d.expert_gating == "softmax")
    n = d.n_layers
    if window:
        assert cfg["sliding_window_size"] == 4096
        assert cfg["sliding_window_layout"] == [int(i % 4 != 0) for i in range(n)]
        assert cfg["rope_layout"] == [int(i % 4 != 0) for i in range(n)]
    else:
        assert not any(cfg["sliding_window_layout"]) and all(cfg["rope_layout"])
    t = load_safetensors(out / "model.safetensors")
    p = "model.layers.0.block_sparse_moe."
    assert t[p + "primary_router.weight"].shape == (d.n_experts, d.n_embd)
    assert t[p + f"experts.{d.n_experts - 1}.down.weight"].shape == (d.n_embd, 64)
    names = [n for n in t if ".experts." not in n]
    names += [f"model.layers.0.block_sparse_moe.experts.{w}.weight" for w in ("gate", "up", "down")]
    mapped = _mapped(gguf.MODEL_ARCH.SMALLTHINKER, n, names)
    assert all(mapped.values()), [k for k, v in mapped.items() if not v]
    assert mapped[p + "primary_router.weight"] == "blk.0.ffn_gate_inp.weight"
    assert mapped[p + "experts.gate.weight"] == "blk.0.ffn_gate_exps.weight"
