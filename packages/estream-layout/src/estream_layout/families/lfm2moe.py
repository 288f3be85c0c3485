"""LFM2-MoE (llama.cpp `lfm2moe`): a hybrid of gated short-convolution layers (no KV heads) and
grouped-query attention layers (per-head q/k RMSNorm, NeoX RoPE), leading dense layers, then
experts under a sigmoid router with a required selection bias (`exp_probs_b`), the selected
weights renormalised. The final norm is `token_embd_norm`, the output tied to the embedding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType, Keys

from ..errors import InvalidGGUFError
from ..limits import MAX_CONV_CACHE
from . import Family, KeyList
from ._plan import Plan, Want

__all__ = ["FAMILY"]

U32 = GGUFValueType.UINT32
F32 = GGMLQuantizationType.F32


def _layer(want: Want, i: int) -> None:
    s, p, w = want.spec, f"blk.{i}.", want.required
    d = s.n_embd
    want.norms(i)
    if s.n_head_kv[i] > 0:
        want.gqa(i)
    else:  # the short convolution
        w[p + "shortconv.conv.weight"] = (d, s.shortconv_l_cache)
        w[p + "shortconv.in_proj.weight"] = (3 * d, d)
        w[p + "shortconv.out_proj.weight"] = (d, d)
    want.ffn_or_moe(i, bias="required")


def _check(
    meta: Any,
    tensors: Mapping[str, Any],
    n_head_kv: tuple[int, ...],
    moe_layers: tuple[int, ...],
    n_experts: int,
    n_embd: int,
    attn_width: int,
) -> None:
    """What llama.cpp's lfm2moe loader requires beyond the generic checks: `shortconv.l_cache`
    (> 1) with a `[n_embd, l_cache]` kernel per convolution layer, MoE exactly from layer
    `leading_dense_block_count` on, each MoE layer's selection bias `exp_probs_b` (`[E]`), and
    attention as wide as the model (`attn_output` is `[n_embd, n_embd]`)."""

    l_cache = meta.integer(Keys.ShortConv.L_CACHE, lo=2, hi=MAX_CONV_CACHE)
    for i, h in enumerate(n_head_kv):
        name = f"blk.{i}.shortconv.conv.weight"
        if h == 0 and (name not in tensors or tensors[name].shape != (n_embd, l_cache)):
            got = tensors[name].shape if name in tensors else "missing"
            raise InvalidGGUFError(
                f"{meta.path}: layer {i} has no KV heads (a short convolution), so it needs "
                f"{name} of shape ({n_embd}, {l_cache}) [n_embd, shortconv.l_cache]; got {got}"
            )
    for i in moe_layers:
        name = f"blk.{i}.exp_probs_b.bias"
        if name not in tensors or tensors[name].shape != (n_experts,):
            got = tensors[name].shape if name in tensors else "missing"
            raise InvalidGGUFError(
                f"{meta.path}: MoE layer {i} needs its expert selection bias {name} of shape "
                f"({n_experts},) (llama.cpp requires it for lfm2moe); got {got}"
            )
    if any(n_head_kv) and attn_width != n_embd:
        raise meta.fail(
            Keys.Attention.HEAD_COUNT,
            f"x key_length = {attn_width} must equal embedding_length = {n_embd} for lfm2moe "
            "(its attention output projection is square)",
        )


def _synth_layer(plan: Plan, i: int) -> None:
    d, p = plan.d, f"blk.{i}."
    ne, hd = d.n_embd, d.head_dim
    plan.norm(p + "ffn_norm.weight", ne)
    if i < d.n_leading_dense:
        plan.dense_ffn(i, d.n_ff)
    else:
        plan.experts(i)
        plan.add(p + "exp_probs_b.bias", (d.n_experts,), F32, "bias")
    plan.norm(p + "attn_norm.weight", ne)
    if d.lfm2_is_attention(i):
        plan.norm(p + "attn_q_norm.weight", hd)
        plan.norm(p + "attn_k_norm.weight", hd)
        plan.attention(i, 0.5)
    else:
        # ne {l_cache, n_embd}: a [n_embd, 3] f32 kernel (ne0 = 3, not tileable)
        plan.add(p + "shortconv.conv.weight", (ne, d.l_cache), F32, "conv")
        plan.matrix(p + "shortconv.in_proj.weight", 3 * ne, ne)
        plan.matrix(p + "shortconv.out_proj.weight", ne, ne, 0.5)


def _keys(d: Any) -> KeyList:
    return [
        (Keys.LLM.FEED_FORWARD_LENGTH, d.n_ff, U32),
        (Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, d.n_ff_exp, U32),
        (Keys.LLM.LEADING_DENSE_BLOCK_COUNT, d.n_leading_dense, U32),
        (Keys.LLM.EXPERT_GATING_FUNC, 2, U32),  # sigmoid
        (Keys.ShortConv.L_CACHE, d.l_cache, U32),
        (Keys.Rope.DIMENSION_COUNT, d.head_dim, U32),
    ]


FAMILY = Family(
    name="lfm2moe",
    gguf_arch="lfm2moe",
    rope_type="neox",
    qk_norm="head",
    norm_topk=True,
    gating_key="required",  # its converter writes sigmoid
    leading_dense=True,
    attention="gqa",
    conv_layers=True,
    shared_experts=False,
    final_norm="token_embd_norm.weight",
    layer_tensors=_layer,
    check=_check,
    rope_base=1e6,
    rms_eps=1e-5,
    vocab=None,
    presets={
        "tiny": {"n_layers": 4},
        "small": {"n_layers": 6},
        # LiquidAI/LFM2-8B-A1B config.json: 24 layers, hidden 2048, 32 q / 8 kv heads of 64,
        # layer_types with full attention at layers 2, 6, 10, 14, 18, 21 (the other 18 are
        # gated short convolutions, conv_L_cache 3), num_dense_layers 2 (intermediate_size
        # 7168), 32 experts top-4 of moe_intermediate_size 1792 (sigmoid router with expert
        # bias, norm_topk_prob), vocab 65536, rope_theta 1e6, max_position_embeddings 128000.
        "lfm2-8b-a1b": dict(
            n_layers=24,
            n_embd=2048,
            n_ff_exp=1792,
            n_ff=7168,
            n_experts=32,
            n_experts_used=4,
            n_head=32,
            n_head_kv=8,
            head_dim=64,
            n_vocab=65536,
            n_ctx=128000,
            n_leading_dense=2,
            l_cache=3,
            attention_layers=(2, 6, 10, 14, 18, 21),
        ),
    },
    published=("lfm2-8b-a1b",),
    synth_layer=_synth_layer,
    synth_keys=_keys,
    synth_kv_array=True,
)
