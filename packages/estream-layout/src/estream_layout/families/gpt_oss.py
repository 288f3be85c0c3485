"""gpt-oss (llama.cpp `gpt-oss`, its `LLM_ARCH_OPENAI_MOE`): OpenAI's open-weight MoE.

Every layer is grouped-query attention with biases on q, k, v and the output projection, one
learned sink logit per query head (`attn_sinks`: joins each row's softmax as an extra key of
value zero), NeoX RoPE (YaRN-scaled in the published models) and no q/k norms; then
`post_attention_norm` of the residual (the experts' input: there is no `ffn_norm`) and a mixture of
experts. The router has a bias (`ffn_gate_inp.bias`, added to the logits); the top-k logits are
softmaxed among themselves (llama.cpp's `SOFTMAX_WEIGHT` gating: the same experts and weights as
a softmax over all experts renormalised over the selected ones, which is how the record states
it). Each expert has biases on its three projections (`ffn_{gate,up,down}_exps.bias`, `[E, rows]`)
and the clamped "SwiGLU-OAI" activation (`OAI_ALPHA`, `OAI_LIMIT`). No shared expert; the output
projection is not tied.

llama.cpp's loader reads `attention.sliding_window` (required) and slides the even layers
(`set_swa_pattern(2)`: layer `i` slides iff `i % 2 == 0`), the odd ones attend to everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gguf import GGMLQuantizationType, GGUFValueType, Keys

from . import Family, KeyList
from ._plan import Plan, Want

__all__ = ["FAMILY", "OAI_ALPHA", "OAI_LIMIT", "SWA_PATTERN", "attention_pattern"]

U32 = GGUFValueType.UINT32
F32v = GGUFValueType.FLOAT32
STR = GGUFValueType.STRING
F32 = GGMLQuantizationType.F32

#: SwiGLU-OAI (ggml's `swiglu_oai`, as llama.cpp's graph calls it for gpt-oss):
#: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
#: ``out = g * sigmoid(alpha * g) * (u + 1)``.
OAI_ALPHA: Final = 1.702
OAI_LIMIT: Final = 7.0
#: llama.cpp's layer pattern for gpt-oss: layer i slides iff i % 2 == 0 (the first layer slides).
SWA_PATTERN: Final = 2
#: The published models' window (gpt-oss-20b and -120b: sliding_window 128).
SWA_WINDOW: Final = 128


def attention_pattern(
    meta: Any, n_layers: int, rope_base: float
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(window, sliding layers, NoPE layers) as llama.cpp's loader derives them: the window is
    `attention.sliding_window` (required), the even layers slide, every layer takes RoPE."""
    window = meta.integer(Keys.Attention.SLIDING_WINDOW, lo=1, hi=1 << 31)
    swa = tuple(i for i in range(n_layers) if i % SWA_PATTERN < SWA_PATTERN - 1)
    return window, swa, ()


def _layer(want: Want, i: int) -> None:
    s, p, w = want.spec, f"blk.{i}.", want.required
    d, nh, e = s.n_embd, s.n_head, s.n_experts
    kv, hk, hv = s.n_head_kv[i], s.head_dim_k, s.head_dim_v
    w[p + "attn_norm.weight"] = w[p + "post_attention_norm.weight"] = (d,)
    want.gqa(i)
    w[p + "attn_q.bias"] = (nh * hk,)
    w[p + "attn_k.bias"] = (kv * hk,)
    w[p + "attn_v.bias"] = (kv * hv,)
    w[p + "attn_output.bias"] = (d,)
    w[p + "attn_sinks.weight"] = (nh,)
    w[p + "ffn_gate_inp.weight"] = (e, d)
    w[p + "ffn_gate_inp.bias"] = (e,)
    ff = s.n_ff_exp
    w[p + "ffn_gate_exps.bias"] = w[p + "ffn_up_exps.bias"] = (e, ff)
    w[p + "ffn_down_exps.bias"] = (e, d)


def _synth_layer(plan: Plan, i: int) -> None:
    """Tensors in the order llama.cpp's converter writes a layer's, biases as f32 vectors of
    small random values (drawn like a convolution kernel: N(0, 1) / sqrt(last dim))."""
    d, p = plan.d, f"blk.{i}."
    ne, hd, nh, nkv, e, ff = d.n_embd, d.head_dim, d.n_head, d.n_head_kv, d.n_experts, d.n_ff_exp
    plan.norm(p + "attn_norm.weight", ne)
    plan.attention(i, 0.25)
    plan.add(p + "attn_q.bias", (nh * hd,), F32, "conv")
    plan.add(p + "attn_k.bias", (nkv * hd,), F32, "conv")
    plan.add(p + "attn_v.bias", (nkv * hd,), F32, "conv")
    plan.add(p + "attn_output.bias", (ne,), F32, "conv")
    plan.add(p + "attn_sinks.weight", (nh,), F32, "conv")
    plan.norm(p + "post_attention_norm.weight", ne)
    plan.experts(i)
    plan.add(p + "ffn_gate_inp.bias", (e,), F32, "conv")
    plan.add(p + "ffn_gate_exps.bias", (e, ff), F32, "conv")
    plan.add(p + "ffn_up_exps.bias", (e, ff), F32, "conv")
    plan.add(p + "ffn_down_exps.bias", (e, ne), F32, "conv")


def _keys(d: Any) -> KeyList:
    out: KeyList = [
        (Keys.LLM.FEED_FORWARD_LENGTH, d.n_ff_exp, U32),  # the converter writes the expert width
        (Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, d.n_ff_exp, U32),
        (Keys.Attention.HEAD_COUNT_KV, d.n_head_kv, U32),
        (Keys.Attention.KEY_LENGTH, d.head_dim, U32),
        (Keys.Attention.VALUE_LENGTH, d.head_dim, U32),
        (Keys.Attention.SLIDING_WINDOW, d.sliding_window or SWA_WINDOW, U32),
        (Keys.Rope.DIMENSION_COUNT, d.head_dim, U32),
    ]
    if d.yarn_factor > 0:
        out += [
            (Keys.Rope.SCALING_TYPE, "yarn", STR),
            (Keys.Rope.SCALING_FACTOR, d.yarn_factor, F32v),
            (Keys.Rope.SCALING_ORIG_CTX_LEN, d.yarn_orig_ctx, U32),
        ]
    return out


_PRESETS: Final[Mapping[str, Mapping[str, Any]]] = {
    # a window shorter than a test prompt, and YaRN over a short original context, so that both
    # change the logits; two layers: one sliding, one full
    "tiny": {"sliding_window": 8, "yarn_factor": 4.0, "yarn_orig_ctx": 32},
    "small": {"sliding_window": 16, "yarn_factor": 4.0, "yarn_orig_ctx": 64},
    # openai/gpt-oss-20b config.json: 24 layers, hidden 2880, 64 q / 8 kv heads of 64,
    # 32 experts top-4 of intermediate_size 2880, sliding_window 128 on the even layers
    # (layer_types), rope_theta 150000 with YaRN factor 32 over 4096 original positions,
    # rms_norm_eps 1e-5, vocab 201088 (o200k_harmony), 131072 positions.
    "gpt-oss-20b": dict(
        n_layers=24,
        n_embd=2880,
        n_ff_exp=2880,
        n_ff=2880,
        n_experts=32,
        n_experts_used=4,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_vocab=201088,
        n_ctx=131072,
        sliding_window=SWA_WINDOW,
        yarn_factor=32.0,
        yarn_orig_ctx=4096,
    ),
}

FAMILY = Family(
    name="gpt-oss",
    gguf_arch="gpt-oss",
    rope_type="neox",
    qk_norm="none",
    norm_topk=True,  # softmax over the selected logits = softmax over all, renormalised
    gating_key="fixed",  # llama.cpp's graph fixes the gating; converters write no key
    leading_dense=False,
    attention="gqa",
    conv_layers=False,
    shared_experts=False,
    final_norm="output_norm.weight",
    layer_tensors=_layer,
    check=None,
    rope_base=150000.0,
    rms_eps=1e-5,
    vocab=None,
    presets=_PRESETS,
    published=("gpt-oss-20b",),
    synth_layer=_synth_layer,
    synth_keys=_keys,
    expert_glu="swiglu_oai",
    expert_type="MXFP4",  # the published checkpoints' experts
    attention_pattern=attention_pattern,
)
