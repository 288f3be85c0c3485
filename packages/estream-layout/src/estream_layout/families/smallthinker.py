"""SmallThinker (llama.cpp `smallthinker`): a MoE designed for experts in storage.

Every layer is grouped-query attention (no q/k norms, NeoX RoPE) and a mixture of ReGLU experts
(`down(relu(gate x) * up x)`). The router reads the layer's *input* -- the residual stream before
the attention norm -- so a layer's routes are known before its attention runs; the experts read
`ffn_norm` of the attention's output as usual. Gating is `expert_gating_func` (softmax or
sigmoid, as the converter writes `moe_primary_router_apply_softmax`), the selected weights
renormalised to sum to 1.

With `attention.sliding_window` present and > 0, llama.cpp's loader fixes the window at 4096
tokens whatever the value, and sets the layer pattern of `attention.sliding_window_pattern`
(default 4) with the full-attention layer first: layer `i` slides iff `i % pattern != 0`; the
full layers `i % 4 == 0` (`n_no_rope_layer_step`, 4 and not a GGUF key) take no RoPE (NoPE) —
unless the model has exactly 4 layers: llama.cpp's graph takes RoPE on every layer when the step
equals the layer count (`use_rope = step == n_layer || i % step != 0`).
Without it every layer is full attention with RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gguf import GGUFValueType, Keys

from ..limits import MAX_LAYERS
from . import Family, KeyList
from .olmoe import moe_layer, moe_synth_layer

__all__ = ["FAMILY", "NO_ROPE_LAYER_STEP", "SWA_WINDOW", "attention_pattern"]

U32 = GGUFValueType.UINT32

#: llama.cpp's window for SmallThinker's sliding layers (its loader ignores the file's value).
SWA_WINDOW: Final = 4096
#: llama.cpp's `n_no_rope_layer_step` default: every 4th layer from 0 is NoPE (with a window).
NO_ROPE_LAYER_STEP: Final = 4
_DEFAULT_PATTERN: Final = 4
_SWA_PATTERN: Final = "{arch}.attention.sliding_window_pattern"
_ROPE_BASE_SWA: Final = "{arch}.rope.freq_base_swa"


def attention_pattern(
    meta: Any, n_layers: int, rope_base: float
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(window, sliding layers, NoPE layers) as llama.cpp's loader derives them from a file."""

    window = meta.integer(Keys.Attention.SLIDING_WINDOW, 0, hi=1 << 31)
    if window == 0:
        return 0, (), ()
    pattern = meta.integer(_SWA_PATTERN, _DEFAULT_PATTERN, lo=1, hi=MAX_LAYERS)
    base_swa = meta.number(_ROPE_BASE_SWA, rope_base, hi=1e12)
    if base_swa != rope_base:
        raise meta.fail(
            _ROPE_BASE_SWA,
            f"= {base_swa:g} differs from rope.freq_base = {rope_base:g}; a RoPE base per layer "
            "kind is not implemented",
        )
    swa = tuple(i for i in range(n_layers) if i % pattern != 0)
    # llama.cpp's graph: use_rope = (step == n_layer) || (i % step != 0)
    nope = () if n_layers == NO_ROPE_LAYER_STEP else tuple(range(0, n_layers, NO_ROPE_LAYER_STEP))
    return SWA_WINDOW, swa, nope


def _keys(d: Any) -> KeyList:
    out: KeyList = [
        (Keys.LLM.FEED_FORWARD_LENGTH, d.n_ff_exp, U32),  # the converter writes the expert width
        (Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, d.n_ff_exp, U32),
        (Keys.LLM.EXPERT_GATING_FUNC, {"softmax": 1, "sigmoid": 2}[d.expert_gating], U32),
        (Keys.Attention.HEAD_COUNT_KV, d.n_head_kv, U32),
        (Keys.Attention.KEY_LENGTH, d.head_dim, U32),
        (Keys.Attention.VALUE_LENGTH, d.head_dim, U32),
        (Keys.Rope.DIMENSION_COUNT, d.head_dim, U32),
    ]
    if d.sliding_window > 0:
        out.append((Keys.Attention.SLIDING_WINDOW, d.sliding_window, U32))
    return out


_PRESETS: Final[Mapping[str, Mapping[str, Any]]] = {
    # three layers: with the window, layer 0 is NoPE full attention, 1-2 slide with RoPE (with
    # exactly four, llama.cpp would take RoPE on every layer)
    "tiny": {"n_layers": 3, "sliding_window": SWA_WINDOW, "expert_gating": "sigmoid"},
    # softmax gating and no window: RoPE on every layer
    "small": {"expert_gating": "softmax"},
    # PowerInfer/SmallThinker-4BA0.6B (the model card's table and the config class's
    # defaults): 32 layers, hidden 1536, 12 q / 2 kv heads of 128, 32 experts top-4 of
    # moe_ffn_hidden_size 768, ReGLU, sigmoid router (moe_primary_router_apply_softmax false),
    # vocab 151936 (the Qwen2 tokenizer), rope_theta 1e6, rms_norm_eps 1e-6, 32K context,
    # sliding window 4096 on three layers of four.
    "smallthinker-4b-a0.6b": dict(
        n_layers=32,
        n_embd=1536,
        n_ff_exp=768,
        n_ff=768,
        n_experts=32,
        n_experts_used=4,
        n_head=12,
        n_head_kv=2,
        head_dim=128,
        n_vocab=151936,
        n_ctx=32768,
        sliding_window=SWA_WINDOW,
        expert_gating="sigmoid",
    ),
    # PowerInfer/SmallThinker-21BA3B (the model card's table): 52 layers, hidden 2560, 28 q /
    # 4 kv heads, 64 experts top-6 of 768, ReGLU, vocab 151936, 16K context; router, RoPE
    # base and window as the 4B. Heads of 128: the card gives no head size, 2560 / 28 is not
    # whole (so the checkpoint's config must set head_dim), and SmallThinkerConfig's default
    # head_dim is 128 (the 4B's 12 x 128 = 1536 is its hidden size).
    "smallthinker-21b-a3b": dict(
        n_layers=52,
        n_embd=2560,
        n_ff_exp=768,
        n_ff=768,
        n_experts=64,
        n_experts_used=6,
        n_head=28,
        n_head_kv=4,
        head_dim=128,
        n_vocab=151936,
        n_ctx=16384,
        sliding_window=SWA_WINDOW,
        expert_gating="sigmoid",
    ),
}

FAMILY = Family(
    name="smallthinker",
    gguf_arch="smallthinker",
    rope_type="neox",
    qk_norm="none",
    norm_topk=True,
    gating_key="required",  # llama.cpp has no default for it (its converter always writes it)
    leading_dense=False,
    attention="gqa",
    conv_layers=False,
    shared_experts=False,
    final_norm="output_norm.weight",
    layer_tensors=moe_layer,
    check=None,
    rope_base=1e6,
    rms_eps=1e-6,
    vocab="ggml-vocab-qwen2.gguf",
    presets=_PRESETS,
    published=("smallthinker-4b-a0.6b", "smallthinker-21b-a3b"),
    synth_layer=moe_synth_layer("none"),
    synth_keys=_keys,
    router_input="layer",
    expert_glu="reglu",
    attention_pattern=attention_pattern,
)
