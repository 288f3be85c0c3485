"""One record per model family: the architecture facts every reader of a GGUF shares.

A family module (``families/<family>.py``) holds a `Family` record with what llama.cpp's
loader and graph builder take as given for the architecture: the GGUF keys it reads and what
they mean, the tensors of each kind of layer with their shapes, which layers are dense, mixtures
of experts, attention or convolutions, and the presets of the synthesizer. `ModelSpec` (reading
and checking a file), the packer and `synth_model` read these records; the engine's model file
(``estream/models/<arch>.py``) holds the graph.

Adding a family is one module here and one entry in `RECORDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs

from ._plan import Plan, PlannedTensor, Want

__all__ = [
    "BASE_PRESETS",
    "BY_ARCH",
    "BY_FAMILY",
    "GATING_FUNCS",
    "RECORDS",
    "Family",
    "Plan",
    "PlannedTensor",
    "Want",
    "family_of",
]

# llama_expert_gating_func_type values (src/llama-hparams.h).
GATING_FUNCS: Final = {1: "softmax", 2: "sigmoid"}

#: (key template, value, GGUFValueType) entries of a synthetic model's metadata.
KeyList = list[tuple[str, Any, Any]]


@attrs.frozen
class Family:
    """The facts of one architecture, as llama.cpp's loader and graph builder take them.

    Reading a file: ``gguf_arch`` is its ``general.architecture``; ``rope_type`` how RoPE
    rotates ("norm": adjacent pairs, "neox": halves); ``qk_norm`` where q and k are RMSNormed
    ("none", "full": the whole projection, "head": each head); ``norm_topk`` whether the
    selected router weights are renormalised to sum to 1 (None: the file's
    ``{arch}.expert_weights_norm`` says, default false); ``gating_key`` whether
    ``{arch}.expert_gating_func`` is read ("fixed": softmax whatever the file says,
    "optional": softmax when absent, "required"); ``leading_dense`` whether the experts start at
    ``leading_dense_block_count`` (else every layer is a mixture of experts); ``attention``
    the attention kind ("gqa" or DeepSeek's "mla"); ``conv_layers`` whether a layer without KV
    heads is a short convolution; ``shared_experts`` whether the shared experts' width must be
    ``expert_shared_count`` experts; ``final_norm`` the final norm's tensor (the output
    projection is tied to the embedding when ``output.weight`` is absent); ``layer_tensors``
    fills a `Want` with the non-expert tensors of layer ``i``; ``check`` runs the family's own
    checks of a file (None: none).

    Synthesizing: ``rope_base`` and ``rms_eps`` as the real models have them, ``vocab`` the
    tokenizer file of the family (None: a generated one), ``presets`` the changes to the shared
    tiny/small presets and the published models' shapes (`SynthDims` fields), ``published`` the
    presets that are one published model of this family, ``synth_layer`` appends a layer's
    tensors to a `Plan`, ``synth_keys`` the family's metadata after the shared keys, and
    ``synth_kv_array`` whether ``head_count_kv`` is written per layer (0 for convolutions),
    ``expert_type`` the GGML type of the synthesized experts unless asked for another.

    The graph: ``router_input`` is what the router reads ("ffn_norm": the experts' input,
    "layer": the layer's input, before attention, so routes are known at layer start);
    ``expert_glu`` the experts' gated activation ("swiglu": silu(gate) * up, "reglu":
    relu(gate) * up, "swiglu_oai": gpt-oss's clamped SwiGLU with expert biases);
    ``attention_pattern(meta, n_layers, rope_base)`` reads the sliding window and which layers
    slide and which take no RoPE (None: every layer full attention with RoPE)."""

    name: str
    gguf_arch: str
    rope_type: str
    qk_norm: str
    norm_topk: bool | None
    gating_key: str
    leading_dense: bool
    attention: str
    conv_layers: bool
    shared_experts: bool
    final_norm: str
    layer_tensors: Callable[[Want, int], None]
    check: Callable[..., None] | None
    rope_base: float
    rms_eps: float
    vocab: str | None
    presets: Mapping[str, Mapping[str, Any]]
    published: tuple[str, ...]
    synth_layer: Callable[[Plan, int], None]
    synth_keys: Callable[[Any], KeyList]
    synth_kv_array: bool = False
    expert_type: str = "Q4_0"
    router_input: str = "ffn_norm"
    expert_glu: str = "swiglu"
    attention_pattern: Callable[..., tuple[int, tuple[int, ...], tuple[int, ...]]] | None = None

    def __attrs_post_init__(self) -> None:
        if self.rope_type not in ("norm", "neox"):
            raise ValueError(f"{self.name}: rope_type {self.rope_type!r}")
        if self.qk_norm not in ("none", "full", "head"):
            raise ValueError(f"{self.name}: qk_norm {self.qk_norm!r}")
        if self.gating_key not in ("fixed", "optional", "required"):
            raise ValueError(f"{self.name}: gating_key {self.gating_key!r}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"{self.name}: attention {self.attention!r}")
        if self.router_input not in ("ffn_norm", "layer"):
            raise ValueError(f"{self.name}: router_input {self.router_input!r}")
        if self.expert_glu not in ("swiglu", "reglu", "swiglu_oai"):
            raise ValueError(f"{self.name}: expert_glu {self.expert_glu!r}")
        missing = [p for p in self.published if p not in self.presets]
        if missing:
            raise ValueError(f"{self.name}: published presets {missing} have no dimensions")


# The presets every family has (`SynthDims` fields), changed per family by its `presets`.
BASE_PRESETS: Final[Mapping[str, Mapping[str, Any]]] = {
    "tiny": dict(
        n_layers=2,
        n_embd=64,
        n_ff_exp=64,
        n_ff=96,
        n_experts=8,
        n_experts_used=2,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        n_vocab=301,  # not a multiple of 32: exercises output-row padding
        yarn_factor=0.0,
        yarn_orig_ctx=32,
        yarn_log_mul=0.0707,
    ),
    "small": dict(
        n_layers=4,
        n_embd=256,
        n_ff_exp=128,
        n_ff=512,
        n_experts=16,
        n_experts_used=4,
        n_head=8,
        n_head_kv=4,
        head_dim=32,
        n_vocab=1000,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_dim=32,
        qk_nope_dim=64,
        v_head_dim=64,
        yarn_factor=0.0,
        yarn_orig_ctx=64,
        yarn_log_mul=0.0707,
    ),
    # allenai/OLMoE-1B-7B-0924: 16 layers, 64 experts, top-8, d=2048, ff=1024, 16 heads x 128;
    # a size any family can be synthesized at
    "olmoe-1b-7b": dict(
        n_layers=16,
        n_embd=2048,
        n_ff_exp=1024,
        n_ff=1024,
        n_experts=64,
        n_experts_used=8,
        n_head=16,
        n_head_kv=16,
        head_dim=128,
        n_vocab=50304,
        n_ctx=4096,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_rope_dim=64,
        qk_nope_dim=128,
        v_head_dim=128,
    ),
}


def _records() -> tuple[Family, ...]:
    from . import deepseek2, gpt_oss, lfm2moe, mixtral, olmoe, qwen3moe, smallthinker

    return (
        olmoe.FAMILY,
        qwen3moe.FAMILY,
        mixtral.FAMILY,
        deepseek2.FAMILY,
        lfm2moe.FAMILY,
        smallthinker.FAMILY,
        gpt_oss.FAMILY,
    )


#: Every family, in the order the synthesizer lists them.
RECORDS: Final = _records()
#: family name -> record
BY_FAMILY: Final = {f.name: f for f in RECORDS}
#: general.architecture -> record (`llama` only with experts: Mixtral)
BY_ARCH: Final = {f.gguf_arch: f for f in RECORDS}


def family_of(name: str) -> Family:
    """The record of family `name` (KeyError naming the known ones otherwise)."""
    try:
        return BY_FAMILY[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(BY_FAMILY)}") from None
