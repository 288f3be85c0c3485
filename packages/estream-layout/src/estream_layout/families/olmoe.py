"""OLMoE (llama.cpp `olmoe`): pre-norm transformer, q/k RMSNorm over the whole projection,
NeoX RoPE, softmax top-k router without renormalisation, every layer a mixture of experts.

Its layer (attention, then routed experts) is also Qwen3-MoE's and Mixtral's; `moe_layer` and
`moe_synth_layer` are written once here for the three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gguf import GGUFValueType, Keys

from . import Family, KeyList
from ._plan import Plan, Want

__all__ = ["FAMILY", "moe_layer", "moe_synth_layer"]

U32 = GGUFValueType.UINT32


def moe_layer(want: Want, i: int) -> None:
    """A pre-norm layer of grouped-query attention and routed experts."""
    want.norms(i)
    want.gqa(i)
    want.ffn_or_moe(i)


def moe_synth_layer(qk_norm: str) -> Callable[[Plan, int], None]:
    """`attn_norm`, attention (with q/k norms full width, llama.cpp's `{n_embd}`, or per head),
    `ffn_norm`, router and experts."""

    def synth_layer(plan: Plan, i: int) -> None:
        d, p = plan.d, f"blk.{i}."
        plan.norm(p + "attn_norm.weight", d.n_embd)
        plan.attention(i, 0.25)
        if qk_norm != "none":
            width = d.n_embd if qk_norm == "full" else d.head_dim
            plan.norm(p + "attn_q_norm.weight", width)
            plan.norm(p + "attn_k_norm.weight", width)
        plan.norm(p + "ffn_norm.weight", d.n_embd)
        plan.experts(i)

    return synth_layer


def _keys(d: Any) -> KeyList:
    return [
        (Keys.LLM.FEED_FORWARD_LENGTH, d.n_ff_exp, U32),  # olmoe's experts use n_ff
        (Keys.Attention.HEAD_COUNT_KV, d.n_head_kv, U32),
        (Keys.Rope.DIMENSION_COUNT, d.head_dim, U32),
    ]


FAMILY = Family(
    name="olmoe",
    gguf_arch="olmoe",
    rope_type="neox",
    qk_norm="full",
    norm_topk=False,
    gating_key="fixed",
    leading_dense=False,
    attention="gqa",
    conv_layers=False,
    shared_experts=False,
    final_norm="output_norm.weight",
    layer_tensors=moe_layer,
    check=None,
    rope_base=10000.0,
    rms_eps=1e-5,
    vocab="ggml-vocab-mpt.gguf",
    presets={"tiny": {"n_head_kv": 4}, "small": {"n_head_kv": 8}},
    published=(),
    synth_layer=moe_synth_layer("full"),
    synth_keys=_keys,
)
