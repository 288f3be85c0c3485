from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from estream_layout import (
    DenseModelError,
    InvalidGGUFError,
    InvalidMetadataError,
    ModelSpec,
    NotGGUFError,
    TruncatedGGUFError,
    UnalignedReductionError,
    UnsupportedArchitectureError,
    dequantize_tensor,
    synth_model,
    tensor_memmap,
)
from estream_layout.gguf_model import TensorReader

ARCH_ENUM = {
    "olmoe": gguf.MODEL_ARCH.OLMOE,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
    "lfm2moe": gguf.MODEL_ARCH.LFM2MOE,
}


def _known_names(arch: str, n_layers: int) -> set[str]:
    names = set()
    for t in gguf.MODEL_TENSORS[ARCH_ENUM[arch]]:
        base = gguf.TENSOR_NAMES[t]
        for bid in range(n_layers):
            for suffix in ("weight", "bias"):
                names.add(base.format(bid=bid) + "." + suffix)
    return names


@pytest.mark.parametrize("arch", list(ARCH_ENUM))
def test_tensor_names_are_llama_cpp_names(arch: str, tiny_models: dict[str, Path]) -> None:
    spec = ModelSpec.from_gguf(tiny_models[arch])
    unknown = set(spec.tensors) - _known_names(arch, spec.n_layers)
    assert not unknown, f"tensors unknown to gguf's {arch} table: {sorted(unknown)}"


def test_spec_olmoe(tiny_models: dict[str, Path]) -> None:
    s = ModelSpec.from_gguf(tiny_models["olmoe"])
    assert (s.arch, s.family, s.n_layers, s.n_embd, s.n_ff_exp) == ("olmoe", "olmoe", 2, 64, 64)
    assert (s.n_experts, s.n_experts_used, s.moe_layers) == (8, 2, (0, 1))
    assert s.n_head_kv == (4, 4) and s.head_dim_k == 16 and s.n_vocab == 301
    assert s.expert_weights_norm is False and s.expert_gating_func == "softmax"
    assert s.tensors["blk.0.attn_q_norm.weight"].shape == (64,)  # full width
    assert s.tensors["blk.1.ffn_down_exps.weight"].shape == (8, 64, 64)
    assert s.tensors["token_embd.weight"].shape == (301, 64)
    assert s.expert_type == "Q4_0" and s.n_shared_experts == 0


def test_spec_qwen3moe_per_head_norms(tiny_models: dict[str, Path]) -> None:
    s = ModelSpec.from_gguf(tiny_models["qwen3moe"])
    assert s.head_dim_k == 32 and s.n_head == 4 and s.n_head_kv == (2, 2)
    assert s.tensors["blk.0.attn_q_norm.weight"].shape == (32,)
    assert s.tensors["blk.0.attn_q.weight"].shape == (128, 64)  # n_head*head_dim != n_embd
    assert s.expert_weights_norm is True and s.rms_eps == pytest.approx(1e-6)
    assert s.rope_type == "neox"


def test_spec_mixtral_is_llama_with_experts(tiny_models: dict[str, Path]) -> None:
    s = ModelSpec.from_gguf(tiny_models["mixtral"])
    assert s.arch == "llama" and s.family == "mixtral"
    assert not any("q_norm" in n for n in s.tensors)
    assert s.rope_freq_base == 1e6 and s.rope_type == "norm"


def test_spec_deepseek2(tiny_models: dict[str, Path]) -> None:
    s = ModelSpec.from_gguf(tiny_models["deepseek2"])
    assert s.n_leading_dense == 1 and s.moe_layers == (1, 2) and s.n_shared_experts == 1
    assert s.kv_lora_rank == 32 and s.q_lora_rank == 32 and s.head_dim_k_mla == 48
    assert "blk.0.ffn_gate.weight" in s.tensors and "blk.0.ffn_gate_exps.weight" not in s.tensors
    assert s.tensors["blk.1.ffn_gate_shexp.weight"].shape == (64, 64)
    assert s.tensors["blk.1.attn_k_b.weight"].shape == (4, 32, 32)
    assert s.n_head_kv == (1, 1, 1)
    # the MLA and routing facts the engine reads (llama.cpp's deepseek2 hparams)
    assert (s.head_dim_k, s.head_dim_v, s.head_dim_v_mla, s.rope_dims) == (48, 32, 32, 16)
    assert s.n_ff == 96 and s.n_ff_exp == 64 and s.n_ff_shexp == 64
    assert (s.expert_gating_func, s.expert_weights_norm, s.expert_weights_scale) == (
        "softmax",
        False,
        1.0,
    )
    assert (s.expert_group_count, s.expert_group_used_count) == (0, 0)
    # YaRN, as DeepSeek-V2's converter writes it
    assert s.rope_scaling_type == "yarn" and s.rope_freq_scale == pytest.approx(1 / 40)
    assert s.rope_n_ctx_orig == 32 and s.rope_yarn_log_mul == pytest.approx(0.0707)
    assert s.rope_attn_factor == 1.0


def test_spec_deepseek2_checks_mla_and_groups(tmp_path: Path) -> None:
    from estream_layout import InvalidMetadataError, PackFormatError, synth_model

    bad = synth_model("deepseek2", "tiny", tmp_path / "a.gguf", n_layers=3)
    d = ModelSpec.from_gguf(bad).summary()
    with pytest.raises(PackFormatError, match=r"'head_dim_k_mla'.*exceed rope_dims"):
        ModelSpec.from_dict({**d, "head_dim_k_mla": 16})
    with pytest.raises(PackFormatError, match=r"'kv_lora_rank'.*MLA"):
        ModelSpec.from_dict({**d, "kv_lora_rank": 0})
    with pytest.raises(PackFormatError, match=r"'expert_group_count'.*divide"):
        ModelSpec.from_dict({**d, "expert_group_count": 3, "expert_group_used_count": 1})
    with pytest.raises(PackFormatError, match="'rope_scaling_type' is 'ntk'"):
        ModelSpec.from_dict({**d, "rope_scaling_type": "ntk"})
    with pytest.raises(PackFormatError, match="'n_leading_dense'"):
        ModelSpec.from_dict({**d, "n_leading_dense": 4})
    with pytest.raises(PackFormatError, match="'rope_attn_factor'"):
        ModelSpec.from_dict({**d, "rope_attn_factor": 0.0})
    ok = {**d, "expert_group_count": 4, "expert_group_used_count": 2}
    assert ModelSpec.from_dict(ok).expert_group_count == 4
    from estream_layout.testing import mutate_gguf

    g = mutate_gguf(bad, tmp_path / "g.gguf", set_kv={"deepseek2.expert_group_count": 3})
    with pytest.raises(InvalidMetadataError, match="expert_group_count = 3 must divide"):
        ModelSpec.from_gguf(g)
    r = mutate_gguf(bad, tmp_path / "r.gguf", set_kv={"deepseek2.rope.scaling.type": "ntk"})
    with pytest.raises(InvalidMetadataError, match=r"rope.scaling.type = 'ntk'"):
        ModelSpec.from_gguf(r)


def test_spec_lfm2moe_hybrid(tiny_models: dict[str, Path]) -> None:
    s = ModelSpec.from_gguf(tiny_models["lfm2moe"])
    assert s.attention_layers == (1, 3) and s.n_head_kv == (0, 2, 0, 2)
    assert s.moe_layers == (1, 2, 3) and s.n_leading_dense == 1
    assert s.expert_gating_func == "sigmoid" and s.shortconv_l_cache == 3
    assert s.tensors["blk.0.shortconv.conv.weight"].shape == (64, 3)
    assert s.tensors["blk.2.exp_probs_b.bias"].shape == (8,)
    assert "output.weight" not in s.tensors


def test_summary_is_json_able(tiny_models: dict[str, Path]) -> None:
    import json

    d = ModelSpec.from_gguf(tiny_models["deepseek2"]).summary()
    assert "tensors" not in d and json.loads(json.dumps(d))["moe_layers"] == [1, 2]


@pytest.mark.parametrize(
    ("arch", "qk_norm", "gating", "rope"),
    [
        ("olmoe", "full", "softmax", "neox"),
        ("qwen3moe", "head", "softmax", "neox"),
        ("mixtral", "none", "softmax", "norm"),
        ("deepseek2", "none", "softmax", "norm"),
        ("lfm2moe", "head", "sigmoid", "neox"),
    ],
)
def test_architecture_facts_follow_llama_cpp(
    arch: str, qk_norm: str, gating: str, rope: str, tiny_models: dict[str, Path]
) -> None:
    s = ModelSpec.from_gguf(tiny_models[arch])
    assert (s.qk_norm, s.expert_gating_func, s.rope_type) == (qk_norm, gating, rope)


@pytest.mark.parametrize("arch", list(ARCH_ENUM))
def test_from_dict_restores_the_summary(arch: str, tiny_models: dict[str, Path]) -> None:
    import json

    s = ModelSpec.from_gguf(tiny_models[arch])
    back = ModelSpec.from_dict(json.loads(json.dumps(s.summary())))
    assert back.summary() == s.summary()
    assert back.tensors == {} and back.n_head_kv == s.n_head_kv
    assert isinstance(back.moe_layers, tuple)


def test_from_dict_rejects_an_old_or_damaged_spec(tiny_models: dict[str, Path]) -> None:
    from estream_layout import PackFormatError

    d = ModelSpec.from_gguf(tiny_models["olmoe"]).summary()
    old = {k: v for k, v in d.items() if k != "qk_norm"}
    with pytest.raises(PackFormatError, match=r"qk_norm.*pack it again"):
        ModelSpec.from_dict(old)
    with pytest.raises(PackFormatError, match="'qk_norm' is 'per-head'"):
        ModelSpec.from_dict({**d, "qk_norm": "per-head"})
    with pytest.raises(PackFormatError, match=r"'n_layers'.*integer"):
        ModelSpec.from_dict({**d, "n_layers": 2.5})
    with pytest.raises(PackFormatError, match=r"'moe_layers'.*list"):
        ModelSpec.from_dict({**d, "moe_layers": 3})


def test_tensor_access_paths_agree(tiny_models: dict[str, Path]) -> None:
    spec = ModelSpec.from_gguf(tiny_models["olmoe"])
    reader = gguf.GGUFReader(tiny_models["olmoe"])
    ref = {t.name: t for t in reader.tensors}
    info = spec.expert_tensor(1, "up")
    mm = tensor_memmap(spec, info.name)
    assert mm.shape == (8, 64, 36)
    assert np.array_equal(np.asarray(mm).reshape(-1), np.asarray(ref[info.name].data).reshape(-1))
    with TensorReader(spec.path) as rd:
        assert np.array_equal(rd.expert(info, 5), np.asarray(mm[5]))
    f = dequantize_tensor(spec, info.name)
    want = gguf.quants.dequantize(np.asarray(ref[info.name].data), gguf.GGMLQuantizationType.Q4_0)
    assert f.shape == (8, 64, 64) and np.array_equal(f, want)


# ----------------------------------------------------------------------------- bad inputs
def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(NotGGUFError, match="not a GGUF file"):
        ModelSpec.from_gguf(p)
    with pytest.raises(InvalidGGUFError, match="no such file"):
        ModelSpec.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(InvalidGGUFError, match="directory"):
        ModelSpec.from_gguf(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 20])
def test_truncated(tmp_path: Path, tiny_models: dict[str, Path], keep: float) -> None:
    data = tiny_models["olmoe"].read_bytes()
    n = int(len(data) * keep) if keep < 1 else int(keep)
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(TruncatedGGUFError, match="truncated"):
        ModelSpec.from_gguf(p)


def _write_gguf(path: Path, arch: str, kv: dict[str, int], tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for k, v in kv.items():
        w.add_uint32(k, v)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_dense_model(tmp_path: Path) -> None:
    p = _write_gguf(
        tmp_path / "dense.gguf",
        "llama",
        {"llama.block_count": 1, "llama.embedding_length": 32},
        {"blk.0.ffn_up.weight": np.zeros((64, 32), np.float32)},
    )
    with pytest.raises(DenseModelError, match="no experts"):
        ModelSpec.from_gguf(p)


def test_unsupported_arch(tmp_path: Path) -> None:
    p = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"gpt2.block_count": 1}, {})
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported"):
        ModelSpec.from_gguf(p)


def test_unaligned_reduction_dim(tmp_path: Path) -> None:
    p = synth_model(
        "mixtral",
        "tiny",
        tmp_path / "k48.gguf",
        expert_type="F16",
        dense_type="F16",
        output_type="F16",
        n_embd=48,
    )
    with pytest.raises(UnalignedReductionError, match="reduction dimension 48"):
        ModelSpec.from_gguf(p)


def test_legacy_per_expert_tensors(tmp_path: Path) -> None:
    p = _write_gguf(
        tmp_path / "old-mixtral.gguf",
        "llama",
        {"llama.block_count": 1, "llama.expert_count": 2},
        {
            f"blk.0.ffn_{j}.{e}.weight": np.zeros((32, 32), np.float32)
            for j in ("gate", "up", "down")
            for e in range(2)
        },
    )
    with pytest.raises(UnsupportedArchitectureError, match="per-expert tensors"):
        ModelSpec.from_gguf(p)


def _with_extra_kv(src: Path, dst: Path, extra: dict[str, float]) -> Path:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    for key, val in extra.items():
        w.add_key_value(key, val, gguf.GGUFValueType.FLOAT32)
    for t in reader.tensors:
        data = np.asarray(t.data)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_rope_scaling_factor(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    assert ModelSpec.from_gguf(tiny_models["olmoe"]).rope_freq_scale == 1.0
    p = _with_extra_kv(
        tiny_models["olmoe"], tmp_path / "s.gguf", {"olmoe.rope.scaling.factor": 4.0}
    )
    assert ModelSpec.from_gguf(p).rope_freq_scale == 0.25
    p = _with_extra_kv(tiny_models["olmoe"], tmp_path / "l.gguf", {"olmoe.rope.scale_linear": 2.0})
    assert ModelSpec.from_gguf(p).rope_freq_scale == 0.5


# ----------------------------------------------------------------------------- lfm2moe facts
def _rewrite(src: Path, dst: Path, kv: dict[str, int] | None = None, drop: str = "") -> Path:
    """A copy of `src` with some integer keys replaced and the tensor `drop` left out."""
    kv = kv or {}
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in kv:
            w.add_key_value(key, kv[key], gguf.GGUFValueType.UINT32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        if t.name != drop:
            data = np.asarray(t.data)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_lfm2moe_requirements_of_llama_cpp(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    src = tiny_models["lfm2moe"]  # layers 0, 2 convolve, 1, 3 attend; layer 0 dense
    with pytest.raises(InvalidGGUFError, match=r"selection bias blk\.2\.exp_probs_b\.bias"):
        ModelSpec.from_gguf(_rewrite(src, tmp_path / "a.gguf", drop="blk.2.exp_probs_b.bias"))
    with pytest.raises(InvalidGGUFError, match=r"layer 2 has no KV heads.*shortconv\.conv"):
        ModelSpec.from_gguf(_rewrite(src, tmp_path / "b.gguf", drop="blk.2.shortconv.conv.weight"))
    with pytest.raises(InvalidMetadataError, match=r"shortconv\.l_cache = 1 must be >= 2"):
        ModelSpec.from_gguf(_rewrite(src, tmp_path / "c.gguf", {"lfm2moe.shortconv.l_cache": 1}))
    lead = {"lfm2moe.leading_dense_block_count": 2}
    with pytest.raises(InvalidMetadataError, match=r"leading_dense_block_count = 2.*\[1, 2, 3\]"):
        ModelSpec.from_gguf(_rewrite(src, tmp_path / "d.gguf", lead))


def test_from_dict_checks_layer_kinds(tiny_models: dict[str, Path]) -> None:
    from estream_layout import PackFormatError

    d = ModelSpec.from_gguf(tiny_models["lfm2moe"]).summary()
    assert ModelSpec.from_dict(d).attention_layers == (1, 3)
    with pytest.raises(PackFormatError, match=r"'attention_layers'.*exactly the layers with KV"):
        ModelSpec.from_dict({**d, "attention_layers": [1]})
    with pytest.raises(PackFormatError, match=r"'shortconv_l_cache'.*>= 2"):
        ModelSpec.from_dict({**d, "shortconv_l_cache": 1})
    with pytest.raises(PackFormatError, match=r"'moe_layers'.*layers 1\.\.3"):
        ModelSpec.from_dict({**d, "moe_layers": [2, 3]})
    with pytest.raises(PackFormatError, match=r"'n_ff'.*dense FFN width"):
        ModelSpec.from_dict({**d, "n_ff": 0})
    o = ModelSpec.from_gguf(tiny_models["olmoe"]).summary()
    with pytest.raises(PackFormatError, match="only lfm2moe allows"):
        ModelSpec.from_dict({**o, "n_head_kv": [0, 4], "attention_layers": [1]})
