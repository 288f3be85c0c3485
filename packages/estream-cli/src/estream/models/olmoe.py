"""OLMoE (llama.cpp `olmoe`): pre-norm transformer, full-width q/k RMSNorm, softmax top-k router
without renormalisation, every layer a mixture of SwiGLU experts."""

from __future__ import annotations

import attrs
import numpy as np

from estream_layout import ModelSpec

from ..packed import PackedModel
from .ops import Ops
from .weights import Attention, MoE, Weights, bind_attention, bind_head, bind_moe

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: bf16, whose error here is within 5 % of fp32 attention's on every parity row (32
#: prompts each: q4_0 ×1.013 of it, llama.cpp's Q4_0 ×0.992, Q4_K_M ×1.004, Q5_K_M ×0.966,
#: Q6_K ×1.015, Q8_0 ×1.025; docs/benchmarks.md, parity).
ATTENTION_AUTO = "bf16"

__all__ = ["ATTENTION_AUTO", "Layer", "bind", "layer"]


@attrs.frozen
class Layer:
    attn_norm: np.ndarray = attrs.field(eq=False)
    attn: Attention
    ffn_norm: np.ndarray = attrs.field(eq=False)
    moe: MoE


def bind(model: PackedModel) -> Weights[Layer]:
    layers = tuple(
        Layer(
            attn_norm=model.dense(f"blk.{i}.attn_norm.weight").f32(),
            attn=bind_attention(model, i),
            ffn_norm=model.dense(f"blk.{i}.ffn_norm.weight").f32(),
            moe=bind_moe(model, i),
        )
        for i in range(model.hparams.n_layers)
    )
    return Weights(bind_head(model), layers)


def layer(
    ops: Ops,
    hp: ModelSpec,
    w: Layer,
    x: np.ndarray,
    pos: np.ndarray,
    routes: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Attention, then the experts on the FFN norm; ``routes``: the layer's routes when found
    before attention (SmallThinker's layer), else the router runs on the FFN norm."""
    x = ops.add(x, ops.attention(w.attn, ops.rms_norm(x, w.attn_norm), pos))
    return ops.add(x, ops.moe(ops.rms_norm(x, w.ffn_norm), w.moe, routes=routes))
