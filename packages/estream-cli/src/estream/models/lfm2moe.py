"""LFM2-MoE (llama.cpp `lfm2moe`): a hybrid of gated short-convolution and attention layers.

Each layer's mixer is a short convolution (`n_head_kv` of the layer is 0) or grouped-query
attention with per-head q/k RMSNorm and NeoX RoPE; its FFN is a dense SwiGLU for the first
`leading_dense_block_count` layers (nothing is read for them) and otherwise a mixture of SwiGLU
experts under a sigmoid router whose bias (`exp_probs_b`) only steers the top-k selection, the
selected weights renormalised to sum to 1. The final norm is `token_embd_norm`, and the output
projection is tied to the token embedding. As in llama.cpp's `src/models/lfm2.cpp`.
"""

from __future__ import annotations

import attrs
import numpy as np

from estream_layout import ModelSpec

from ..packed import PackedModel
from .ops import Ops
from .weights import (
    FFN,
    Attention,
    MoE,
    ShortConv,
    Weights,
    bind_attention,
    bind_ffn,
    bind_head,
    bind_moe,
    bind_short_conv,
)

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: bf16, whose error here is within 5 % of fp32 attention's on every parity row (32
#: prompts each: q4_0 ×0.990 of it, llama.cpp's Q4_0 ×0.986, Q4_K_M ×0.994, Q5_K_M ×0.996,
#: Q6_K ×1.016, Q8_0 ×1.009; docs/benchmarks.md, parity).
ATTENTION_AUTO = "bf16"

__all__ = ["ATTENTION_AUTO", "Layer", "bind", "layer"]


@attrs.frozen
class Layer:
    """One layer: exactly one of ``conv``/``attn`` (the mixer), one of ``ffn``/``moe``."""

    attn_norm: np.ndarray = attrs.field(eq=False)  # llama.cpp's "operator_norm"
    conv: ShortConv | None
    attn: Attention | None
    ffn_norm: np.ndarray = attrs.field(eq=False)
    ffn: FFN | None  # leading dense layers
    moe: MoE | None

    def __attrs_post_init__(self) -> None:
        if (self.conv is None) == (self.attn is None):
            raise ValueError("an lfm2moe layer has either a short convolution or attention")
        if (self.ffn is None) == (self.moe is None):
            raise ValueError("an lfm2moe layer has either a dense FFN or experts")


def bind(model: PackedModel) -> Weights[Layer]:
    hp = model.hparams
    layers = []
    for i in range(hp.n_layers):
        p = f"blk.{i}."
        is_attention = hp.n_head_kv[i] > 0
        is_moe = i in model.layers
        layers.append(
            Layer(
                attn_norm=model.dense(p + "attn_norm.weight").f32(),
                conv=None if is_attention else bind_short_conv(model, i),
                attn=bind_attention(model, i) if is_attention else None,
                ffn_norm=model.dense(p + "ffn_norm.weight").f32(),
                ffn=None if is_moe else bind_ffn(model, i),
                moe=bind_moe(model, i) if is_moe else None,
            )
        )
    return Weights(bind_head(model, "token_embd_norm.weight"), tuple(layers))


def layer(ops: Ops, hp: ModelSpec, w: Layer, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    h = ops.rms_norm(x, w.attn_norm)
    if w.conv is not None:
        x = ops.add(x, ops.short_conv(w.conv, h))
    else:
        assert w.attn is not None  # checked at construction
        x = ops.add(x, ops.attention(w.attn, h, pos))
    h = ops.rms_norm(x, w.ffn_norm)
    if w.moe is not None:
        return ops.add(x, ops.moe(h, w.moe))
    assert w.ffn is not None
    return ops.add(x, ops.dense_ffn(h, w.ffn))
