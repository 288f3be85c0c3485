"""Qwen3-MoE (llama.cpp `qwen3moe`): OLMoE's layer with per-head q/k RMSNorm, explicit head
dims (n_head x head_dim need not be n_embd), and the selected router weights renormalised."""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType, Keys

from . import Family, KeyList
from .olmoe import moe_layer, moe_synth_layer

__all__ = ["FAMILY"]

U32 = GGUFValueType.UINT32


def _keys(d: Any) -> KeyList:
    return [
        (Keys.LLM.FEED_FORWARD_LENGTH, d.n_ff, U32),
        (Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, d.n_ff_exp, U32),
        (Keys.Attention.HEAD_COUNT_KV, d.n_head_kv, U32),
        (Keys.Attention.KEY_LENGTH, d.head_dim, U32),
        (Keys.Attention.VALUE_LENGTH, d.head_dim, U32),
        (Keys.Rope.DIMENSION_COUNT, d.head_dim, U32),
    ]


FAMILY = Family(
    name="qwen3moe",
    gguf_arch="qwen3moe",
    rope_type="neox",
    qk_norm="head",
    norm_topk=True,
    gating_key="fixed",
    leading_dense=False,
    attention="gqa",
    conv_layers=False,
    shared_experts=False,
    final_norm="output_norm.weight",
    layer_tensors=moe_layer,
    check=None,
    rope_base=1e6,
    rms_eps=1e-6,
    vocab="ggml-vocab-qwen2.gguf",
    presets={
        "tiny": {"head_dim": 32},  # n_head x head_dim != n_embd
        # Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 q / 4 kv heads of 128,
        # 128 experts top-8 of moe_intermediate_size 768, vocab 151936 (the qwen2 tokenizer
        # file), rope_theta 1e6, max_position_embeddings 40960; per-head q/k norms.
        "qwen3-30b-a3b": dict(
            n_layers=48,
            n_embd=2048,
            n_ff_exp=768,
            n_ff=6144,
            n_experts=128,
            n_experts_used=8,
            n_head=32,
            n_head_kv=4,
            head_dim=128,
            n_vocab=151936,
            n_ctx=40960,
        ),
    },
    published=("qwen3-30b-a3b",),
    synth_layer=moe_synth_layer("head"),
    synth_keys=_keys,
)
