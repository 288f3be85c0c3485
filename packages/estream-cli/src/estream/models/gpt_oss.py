"""gpt-oss (llama.cpp `gpt-oss`, `src/models/openai-moe-iswa.cpp`): OpenAI's open-weight MoE.

Each layer: grouped-query attention on `attn_norm` of the input, with biases on q, k, v and
the output projection, NeoX RoPE (YaRN in the published models), one learned sink logit per
query head in every row's softmax, and a sliding window on the sliding layers (the family
record's: the even ones); then the routed experts on `post_attention_norm` of the residual. The
router adds its bias to the logits; the selected experts' weights are the softmax of their
logits (`ModelSpec`: softmax gating, renormalised: the same numbers). The experts add their
biases and use the clamped SwiGLU-OAI (`estream.experts.GLUGraph`). No shared expert.
"""

from __future__ import annotations

import attrs
import numpy as np

from estream_layout import ModelSpec

from ..packed import PackedModel
from .ops import Ops
from .weights import Attention, MoE, Weights, bind_attention, bind_head, bind_moe

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: f32. At 32 prompts a row its `q4_0` parity row is over 5 % of fp32 attention's
#: error with either bf16 mode (bf16 ×1.100, bf16-pv ×1.052), its `lq8_0` row with bf16 (×1.089).
ATTENTION_AUTO = "f32"

__all__ = ["ATTENTION_AUTO", "Layer", "bind", "layer"]


@attrs.frozen
class Layer:
    attn_norm: np.ndarray = attrs.field(eq=False)
    attn: Attention
    bq: np.ndarray = attrs.field(eq=False)
    bk: np.ndarray = attrs.field(eq=False)
    bv: np.ndarray = attrs.field(eq=False)
    bo: np.ndarray = attrs.field(eq=False)
    sinks: np.ndarray = attrs.field(eq=False)  # [n_head] logits
    post_norm: np.ndarray = attrs.field(eq=False)
    moe: MoE


def bind(model: PackedModel) -> Weights[Layer]:
    def f32(name: str) -> np.ndarray:
        return np.ascontiguousarray(model.dense(name).f32(), dtype=np.float32)

    layers = tuple(
        Layer(
            attn_norm=f32(f"blk.{i}.attn_norm.weight"),
            attn=bind_attention(model, i),
            bq=f32(f"blk.{i}.attn_q.bias"),
            bk=f32(f"blk.{i}.attn_k.bias"),
            bv=f32(f"blk.{i}.attn_v.bias"),
            bo=f32(f"blk.{i}.attn_output.bias"),
            sinks=f32(f"blk.{i}.attn_sinks.weight"),
            post_norm=f32(f"blk.{i}.post_attention_norm.weight"),
            moe=bind_moe(model, i),
        )
        for i in range(model.hparams.n_layers)
    )
    return Weights(bind_head(model), layers)


def attention(ops: Ops, w: Layer, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """q/k/v projections with their biases, RoPE, windowed attention with sinks, output
    projection with its bias."""
    a, t = w.attn, h.shape[0]
    q, k, v = ops.matmuls(h, (a.wq, a.wk, a.wv), "attn_qkv")
    q, k, v = ops.add_row(q, w.bq), ops.add_row(k, w.bk), ops.add_row(v, w.bv)
    q = np.ascontiguousarray(q.reshape(t, a.n_head, a.head_dim))
    k = np.ascontiguousarray(k.reshape(t, a.n_head_kv, a.head_dim))
    v = np.ascontiguousarray(v.reshape(t, a.n_head_kv, -1))
    if a.rope is not None:
        ops.rope(q, pos, a.rope)
        ops.rope(k, pos, a.rope)
    o = ops.attend(q, k, v, a.scale, window=a.window, sinks=w.sinks)
    o = ops.matmul(np.ascontiguousarray(o.reshape(t, -1)), a.wo, "attn_out")
    return ops.add_row(o, w.bo)


def layer(ops: Ops, hp: ModelSpec, w: Layer, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    x = ops.add(x, attention(ops, w, ops.rms_norm(x, w.attn_norm), pos))
    return ops.add(x, ops.moe(ops.rms_norm(x, w.post_norm), w.moe))
