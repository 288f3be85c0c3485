"""The engine's accounted resident memory counts the weight copies it makes beside the dense
blob and the experts (`Engine.weight_copy_bytes`, metric ``weight_copy_bytes``): gpt-oss's
expert biases laid out for the expert op, the routers transposed at bind, the transposed f32
copy of every dense matrix stored as F32. Expected figures are computed from the pack's tensor
shapes, not from the engine's arrays."""

from __future__ import annotations

import numpy as np
import pytest

import estream
from estream.packed import PackedModel
from estream_layout import pack_model, synth_model

TOKENS = np.arange(1, 10)


def _pack(tmp_path_factory, arch: str, dense_type: str):
    d = tmp_path_factory.mktemp(f"copies-{arch}-{dense_type}")
    synth_model(arch, "tiny", d / "m.gguf", seed=5, dense_type=dense_type)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return _pack(tmp_path_factory, "gpt-oss", "Q4_0")


@pytest.fixture(scope="module")
def olmoe_f32(tmp_path_factory):
    return _pack(tmp_path_factory, "olmoe", "F32")


@pytest.fixture(scope="module")
def deepseek2(tmp_path_factory):
    return _pack(tmp_path_factory, "deepseek2", "Q4_0")


def _f32_bytes(shape) -> int:
    return 4 * int(np.prod(shape))


def _bind_copies(path) -> int:
    """Bytes bound outside the dense blob: each router transposed ([E, d] f32), each MoE
    layer's expert order and position tables."""
    model = PackedModel(path)
    hp = model.hparams
    n = 0
    for i in hp.moe_layers:
        n += _f32_bytes((hp.n_experts, hp.n_embd))
        lay = model.layers[i]
        n += lay.order.nbytes + lay.position.nbytes
    return n


def _expert_bias_bytes(path) -> int:
    """gpt-oss's gate/up ([E, d_ff]) and down ([E, d]) expert biases of every MoE layer."""
    hp = PackedModel(path).hparams
    per_layer = _f32_bytes((hp.n_experts, hp.n_ff_exp)) * 2 + _f32_bytes((hp.n_experts, hp.n_embd))
    return per_layer * len(hp.moe_layers)


def _f32_matrix_bytes(path) -> int:
    """The dense 2-D matrices stored as F32 that a pass multiplies by (the token embedding is
    read by rows, the routers are bound transposed already, biases are added)."""
    model = PackedModel(path)
    return sum(
        int(t.bytes)
        for name, t in model.parsed.dense.items()
        if t.format == "f32"
        and len(t.shape) == 2
        and name != "token_embd.weight"
        and not name.endswith(("ffn_gate_inp.weight", ".bias"))
    )


@pytest.mark.parametrize("opts", [{"mode": "resident"}, {"G": 2, "Q": 2, "B": 2}])
def test_gpt_oss_expert_biases_counted(gpt_oss, opts) -> None:
    """On tiny gpt-oss the accounted copies are exactly the expert biases plus the bind-time
    copies (its dense matrices are tiled: no transposed f32 copy), at load and in a pass's
    metrics; a figure missing the biases fails."""
    want = _expert_bias_bytes(gpt_oss) + _bind_copies(gpt_oss)
    assert _f32_matrix_bytes(gpt_oss) == 0
    with estream.load(gpt_oss, **opts) as eng:
        assert eng.weight_copy_bytes == want
        res = eng.prefill(TOKENS)
        assert res.metrics["weight_copy_bytes"] == want
        assert eng.experts.graph.bias_bytes == _expert_bias_bytes(gpt_oss) > 0


def test_f32_dense_transposes_counted(olmoe_f32) -> None:
    """On a tiny OLMoE whose dense matrices are stored as F32, a pass's metrics count the
    transposed f32 copy of every such matrix (made on first use) besides the bind-time
    copies; a second pass adds nothing (the copies are made once)."""
    extra = _f32_matrix_bytes(olmoe_f32)
    assert extra > 0
    want = _bind_copies(olmoe_f32) + extra
    with estream.load(olmoe_f32, mode="resident") as eng:
        first = eng.prefill(TOKENS).metrics["weight_copy_bytes"]
        second = eng.prefill(TOKENS[:3]).metrics["weight_copy_bytes"]
    assert first == second == want


def _mla_decompression_bytes(path) -> int:
    """DeepSeek-V2's f32 matrices made at bind from the split ``attn_k_b`` (``[H*nope, rank]``
    every layer) and, where a head's rows are not whole tiles (tiny shapes), ``attn_v_b``
    (``[H*d_v, rank]``)."""
    model = PackedModel(path)
    hp = model.hparams
    n = 0
    for i in range(hp.n_layers):
        if not model.has(f"blk.{i}.attn_k_b.weight"):
            continue
        nope = hp.head_dim_k_mla - hp.rope_dims
        n += _f32_bytes((hp.n_head * nope, hp.kv_lora_rank))
        if hp.head_dim_v_mla % 32:
            n += _f32_bytes((hp.n_head * hp.head_dim_v_mla, hp.kv_lora_rank))
    return n


def test_mla_decompression_matrices_are_one_copy(deepseek2) -> None:
    """DeepSeek-V2's decompression matrices, made in f32 at bind, are stored as the f32 matmul
    reads them ([in, out]): the accounted copies are those matrices once, the same at load
    and after each pass (a [out, in] matrix plus the transposed copy a first pass made
    counted them twice), and the pass is the same as before (logits equal across passes)."""
    extra = _mla_decompression_bytes(deepseek2)
    assert extra > 0
    want = _bind_copies(deepseek2) + extra + _f32_matrix_bytes(deepseek2)
    with estream.load(deepseek2, mode="resident") as eng:
        assert eng.weight_copy_bytes == want
        a = eng.prefill(TOKENS)
        b = eng.prefill(TOKENS)
    assert a.metrics["weight_copy_bytes"] == b.metrics["weight_copy_bytes"] == want
    assert np.array_equal(a.logits, b.logits)


def test_profile_budget_counts_copies(gpt_oss, monkeypatch) -> None:
    """The profile the configurator plans against holds the dense weights and their copies
    in its non-arena memory even when the measured high-water mark misses them (read as 0
    here): a budget that fits the dense weights and the smallest arena but not the copies is
    refused, and one with room for the copies is accepted."""
    import estream_sched as es
    from estream import memory, profiling

    monkeypatch.setattr(memory, "peak_rss", lambda: 0)
    monkeypatch.setattr(memory, "mem_available", lambda: 0)
    prof = profiling.profile_model(gpt_oss, candidates=(2,), n_tokens=8, bw_rounds=1)
    dense = PackedModel(gpt_oss).parsed.dense_bytes
    copies = _expert_bias_bytes(gpt_oss) + _bind_copies(gpt_oss)
    assert prof.m_other[2] == dense + copies
    with pytest.raises(es.BudgetError) as err:
        es.configure(prof, 1)
    arena = err.value.minimum_bytes - prof.m_other[2]
    assert arena > 0
    with pytest.raises(es.BudgetError):
        es.configure(prof, dense + arena + copies - 1)
    assert es.configure(prof, dense + arena + copies).memory_bytes <= dense + arena + copies
