"""SmallThinker (llama.cpp `smallthinker`): the router reads the layer's input.

Each layer routes its input (the residual stream before the attention norm) first, so the
layer's routes are known before its attention runs (the expert source is told: streamed, it
reads the routed groups while attention runs); then grouped-query attention (NeoX RoPE,
none on the NoPE layers; a sliding window on the sliding layers), then ReGLU experts on the
FFN norm of the attention's output, weighted by the routes found at the start. As in llama.cpp's
`src/models/smallthinker.cpp`; which layers slide or skip RoPE is the family record's (read
into `ModelSpec`). Its weights are OLMoE's (`olmoe.Layer`, `olmoe.bind`: the same tensors, the
ReGLU being the family record's `expert_glu`), and so is the rest of its layer (`olmoe.layer`,
given the routes): only routing first is its own.
"""

from __future__ import annotations

import numpy as np

from estream_layout import ModelSpec

from . import olmoe
from .olmoe import Layer, bind
from .ops import Ops

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: bf16 P·V. At 32 prompts a row its six q8 parity rows keep that mode's error
#: within 5 % of fp32 attention's (×0.958–1.041) where two of bf16's do not (×1.051, ×1.055).
ATTENTION_AUTO = "bf16-pv"

__all__ = ["ATTENTION_AUTO", "Layer", "bind", "layer"]


def layer(ops: Ops, hp: ModelSpec, w: Layer, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    routes = ops.route(x, w.moe, before_attention=True)  # on the layer's input
    return olmoe.layer(ops, hp, w, x, pos, routes=routes)
