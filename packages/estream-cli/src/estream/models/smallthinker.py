"""SmallThinker (llama.cpp `smallthinker`): the router reads the layer's input.

Each layer routes its input (the residual stream before the attention norm) first, so the
layer's routes are known before its attention runs (the expert source is told: streamed, it
reads the routed groups while attention runs); then grouped-query attention (NeoX RoPE,
none on the NoPE layers; a sliding window on the sliding layers), then ReGLU experts on the
FFN norm of the attention's output, weighted by the routes found at the start. As in llama.cpp's
`src/models/smallthinker.cpp`; which layers slide or skip RoPE is the family record's (read
into `ModelSpec`).
"""

from __future__ import annotations

import attrs
import numpy as np

from estream_layout import ModelSpec

from ..packed import PackedModel
from .ops import Ops
from .weights import Attention, MoE, Weights, bind_attention, bind_head, bind_moe

__all__ = ["Layer", "bind", "layer"]


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


def layer(ops: Ops, hp: ModelSpec, w: Layer, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    routes = ops.route(x, w.moe, before_attention=True)  # on the layer's input
    x = ops.add(x, ops.attention(w.attn, ops.rms_norm(x, w.attn_norm), pos))
    return ops.add(x, ops.moe(ops.rms_norm(x, w.ffn_norm), w.moe, routes=routes))
