"""Mixtral (llama.cpp `llama` with experts): OLMoE's layer without q/k norms, adjacent-pair
("norm") RoPE, the selected router weights renormalised. A `llama` GGUF is this family only
when it has experts (`llama.expert_count` > 0)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType, Keys

from . import Family, KeyList
from .olmoe import moe_layer, moe_synth_layer

__all__ = ["FAMILY"]

U32 = GGUFValueType.UINT32


def _keys(d: Any) -> KeyList:
    return [
        (Keys.LLM.FEED_FORWARD_LENGTH, d.n_ff_exp, U32),  # llama's experts use n_ff
        (Keys.Attention.HEAD_COUNT_KV, d.n_head_kv, U32),
        (Keys.Rope.DIMENSION_COUNT, d.head_dim, U32),
    ]


FAMILY = Family(
    name="mixtral",
    gguf_arch="llama",
    rope_type="norm",
    qk_norm="none",
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
    rms_eps=1e-5,
    vocab="ggml-vocab-llama-spm.gguf",
    presets={
        # mistralai/Mixtral-8x7B-v0.1 config.json: 32 layers, hidden 4096, 32 q / 8 kv heads of
        # 128, 8 experts top-2 of intermediate_size 14336, vocab 32000 (llama SPM tokenizer),
        # rope_theta 1e6, max_position_embeddings 32768.
        "mixtral-8x7b": dict(
            n_layers=32,
            n_embd=4096,
            n_ff_exp=14336,
            n_ff=14336,
            n_experts=8,
            n_experts_used=2,
            n_head=32,
            n_head_kv=8,
            head_dim=128,
            n_vocab=32000,
            n_ctx=32768,
        ),
    },
    published=("mixtral-8x7b",),
    synth_layer=moe_synth_layer("none"),
    synth_keys=_keys,
)
