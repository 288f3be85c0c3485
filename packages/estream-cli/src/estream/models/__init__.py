"""One module per architecture, as llama.cpp's `src/models/<arch>.cpp`, over shared `ops`.

An architecture module has a frozen attrs class for its layer weights and two functions:

* ``bind(model) -> Weights``: the model's resident weights, typed, read once;
* ``layer(ops, hp, w, x, pos) -> x``: one layer's forward pass, written top to bottom.

The engine's loop calls ``layer`` for each layer in turn; it tells the expert source when an MoE
layer starts (before attention, so that reads overlap it) and does the timing, spans and progress,
so that a layer function holds only the math. A layer without routed experts (a leading dense
layer) simply never calls ``ops.moe``: nothing is read for it.

An architecture module also states ``ATTENTION_AUTO`` (above). Adding an architecture is one new
module here and one line in `ARCHITECTURES`, keyed by GGUF's
``general.architecture``. Its facts (RoPE type, q/k norm, gating, …) come from estream-layout's
`ModelSpec`, stored in the packed model's manifest.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from estream_layout import ModelSpec

from ..errors import UnsupportedModelError
from ..packed import PackedModel
from . import deepseek2, gpt_oss, lfm2moe, llama, olmoe, qwen3moe, smallthinker
from .ops import Ops
from .weights import Weights

__all__ = ["ARCHITECTURES", "Architecture", "architecture"]


class Architecture(Protocol):
    """What the engine needs of an architecture module (and ``ATTENTION_AUTO``: "bf16",
    "bf16-pv" or "f32", what ``attention="auto"`` runs on a kernel set with native bf16
    products: a bf16 mode only where every row of the parity table shows its error within 5 %
    of fp32 attention's, bf16 before bf16-pv)."""

    ATTENTION_AUTO: str

    def bind(self, model: PackedModel) -> Weights[Any]: ...

    def layer(
        self, ops: Ops, hp: ModelSpec, w: Any, x: np.ndarray, pos: np.ndarray
    ) -> np.ndarray: ...


# general.architecture -> the module with its forward pass.
ARCHITECTURES: dict[str, Architecture] = {
    "olmoe": olmoe,
    "qwen3moe": qwen3moe,
    "llama": llama,  # with experts: Mixtral
    "deepseek2": deepseek2,
    "lfm2moe": lfm2moe,
    "smallthinker": smallthinker,
    "gpt-oss": gpt_oss,
}


def architecture(hp: ModelSpec) -> Architecture:
    """The module that computes `hp.arch`, or a clear error for one without an engine graph."""
    arch = ARCHITECTURES.get(hp.arch)
    if arch is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(
            f"architecture {hp.arch!r} has no engine graph yet (supported: {known})"
        )
    return arch
