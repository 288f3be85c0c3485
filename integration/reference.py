"""An independent float64 numpy forward pass over an *original* GGUF MoE model.

This is the yardstick the engine (and llama.cpp) is measured against. It reads the GGUF with
``gguf.GGUFReader``, dequantizes every tensor with ``gguf.quants.dequantize`` to float64 and runs
the architecture as written in its definition, following llama.cpp's conventions exactly (they
were checked against llama.cpp's ``src/models/<arch>.cpp``, ``build_moe_ffn`` in
``src/llama-graph.cpp``, ``llama_model_rope_type`` in ``src/llama-model.cpp`` and the CPU RoPE in
``ggml-cpu/ops.cpp``, as vendored by llama-cpp-python 0.3.36):

* RMSNorm ``x / sqrt(mean(x²) + eps) * w`` with eps from ``<arch>.attention.layer_norm_rms_epsilon``.
* RoPE style per architecture: ``llama`` (Mixtral) and ``deepseek2`` use "normal" RoPE, which
  rotates adjacent pairs ``(x[2i], x[2i+1])``; ``olmoe``, ``qwen3moe`` and ``lfm2moe`` use NeoX
  RoPE, which rotates ``(x[i], x[i + n_rot/2])``. Angle ``pos * freq_scale * base^(-2i/n_rot)``
  (divided by ``rope_freqs[i]`` when a ``rope_freqs.weight`` tensor exists). Dimensions past
  ``n_rot`` pass through.
  *Q/K permutation in ``llama`` GGUFs:* llama.cpp's converter permutes the rows of Q and K of
  Hugging Face Llama/Mixtral checkpoints so that the HF "rotate-half" RoPE becomes llama.cpp's
  adjacent-pair RoPE on the GGUF weights. We read the GGUF, so we apply adjacent-pair RoPE to the
  GGUF rows as they are — the same function llama.cpp computes. (A synthetic ``llama`` GGUF
  written with random Q/K is a valid model under that convention.)
* Q/K norms: OLMoE normalises the *whole* projected q (width ``n_head*head_dim``) and k
  (``n_head_kv*head_dim``) before the head split; Qwen3-MoE and LFM2 normalise each head over
  ``head_dim``. Both are applied before RoPE.
* Attention: causal, scale ``1/sqrt(head_dim)`` (DeepSeek-2: ``1/sqrt(key_length_mla)``, with the
  YaRN mscale² factor, which is 1 without YaRN), GQA maps query head ``h`` to kv head
  ``h // (n_head / n_head_kv)`` (ggml's broadcast).
* MoE routing (``build_moe_ffn``): router logits → softmax (or sigmoid, or the other gating
  functions) → top-k on the probabilities (plus ``exp_probs_b`` for *selection only*, and
  DeepSeek group-limited selection when ``expert_group_count > 1``) → the *unbiased*
  probabilities of the chosen experts as weights → optional normalisation to sum 1 → optional
  scale. Per architecture, as llama.cpp does it: OLMoE: softmax, no normalisation; Qwen3-MoE and
  Mixtral: softmax, normalised; DeepSeek-2: gating/normalisation/scale from metadata (gating
  defaults to softmax); LFM2-MoE: gating from metadata, normalised. The expert weight scale is
  only read for DeepSeek-2, as llama.cpp does. Experts are SwiGLU: ``down(silu(gate x) * up x)``;
  SmallThinker's are ReGLU (``relu`` for ``silu``), its gating from metadata, normalised, and
  its router reads the layer's input (before the attention norm), not the FFN norm's output.
* gpt-oss: biases on q/k/v/o, a learned sink logit per query head in each row's softmax,
  NeoX RoPE (YaRN in the published models), the window ``attention.sliding_window`` on the
  even layers; ``post_attention_norm`` (not ``ffn_norm``) feeds the experts; the router adds its
  bias to the logits, picks the top-k logits and softmaxes them among themselves; experts add
  their biases and use the clamped ``swiglu_oai``.
* SmallThinker attention: no q/k norms, NeoX RoPE; with a sliding window in the file, the
  window is 4096 tokens on layers ``i % sliding_window_pattern != 0`` and layers ``i % 4 == 0``
  take no RoPE, as llama.cpp's loader sets them.
* Output head ``output.weight``, or the tied ``token_embd.weight`` when it is absent.

* RoPE scaling ``none``/``linear``/``yarn``, with YaRN's ramp, magnitude factor and (DeepSeek-2)
  ``mscale²`` attention scale computed as ``llama_context`` does for llama.cpp's defaults.

Float64 throughout. Experts are dequantized one expert at a time and the output head a block of
vocabulary rows at a time, so memory stays near the activations plus the largest dense matrix.
Checked against llama.cpp itself by ``integration/bench/parity.py``: with F32 weights and an F32
KV cache the two agree to ~3e-7 relative L2 on all five architectures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import attrs
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

__all__ = [
    "GATING_SIGMOID",
    "GATING_SOFTMAX",
    "GATING_SOFTMAX_WEIGHT",
    "GATING_SQRT_SOFTPLUS",
    "SUPPORTED_ARCHS",
    "ReferenceConfig",
    "ReferenceModel",
    "RopeParams",
    "UnsupportedModelError",
    "moe_ffn",
    "reference_forward",
    "rms_norm",
    "rope",
    "route",
    "yarn_corr_dims",
]

SUPPORTED_ARCHS = (
    "olmoe",
    "qwen3moe",
    "llama",
    "deepseek2",
    "lfm2moe",
    "smallthinker",
    "gpt-oss",
)

# llama.cpp's llama_expert_gating_func_type values (src/llama-hparams.h).
GATING_NONE = 0
GATING_SOFTMAX = 1
GATING_SIGMOID = 2
GATING_SOFTMAX_WEIGHT = 3
GATING_SQRT_SOFTPLUS = 4

ROPE_NORM = "norm"  # adjacent pairs (x[2i], x[2i+1])
ROPE_NEOX = "neox"  # halves (x[i], x[i + n_rot/2])

_ROPE_STYLE = {
    "llama": ROPE_NORM,
    "deepseek2": ROPE_NORM,
    "olmoe": ROPE_NEOX,
    "qwen3moe": ROPE_NEOX,
    "lfm2moe": ROPE_NEOX,
    "smallthinker": ROPE_NEOX,
    "gpt-oss": ROPE_NEOX,
}

# SmallThinker's attention pattern as llama.cpp's loader sets it when the file has a sliding
# window: the window is 4096 tokens whatever the file says, layer i slides iff
# i % sliding_window_pattern != 0 (default 4), and layer i takes no RoPE iff i % 4 == 0
# (llama.cpp's n_no_rope_layer_step). Without a window: full attention with RoPE everywhere.
SMALLTHINKER_SWA = 4096
SMALLTHINKER_NOPE_STEP = 4
# gpt-oss (llama.cpp's OPENAI_MOE): attention.sliding_window is required and the even layers
# slide (set_swa_pattern(2)); its experts' clamped SwiGLU (ggml's swiglu_oai) constants.
GPT_OSS_SWA_PATTERN = 2
OAI_ALPHA = 1.702
OAI_LIMIT = 7.0


class UnsupportedModelError(ValueError):
    """The GGUF uses an architecture or a feature the reference does not implement."""


# --------------------------------------------------------------------------------------------
# Building blocks (float64, numpy). Public so that tests can check them on their own.
# --------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * weight``."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's expert activation (ggml ``swiglu_oai``): ``g = min(gate, 7)``,
    ``u = clamp(up, -7, 7)``, ``g · sigmoid(1.702 g) · (u + 1)``."""
    g = np.minimum(gate, OAI_LIMIT)
    u = np.clip(up, -OAI_LIMIT, OAI_LIMIT)
    return g / (1.0 + np.exp(-OAI_ALPHA * g)) * (u + 1.0)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


@attrs.frozen
class RopeParams:
    """Everything ``ggml_rope_ext`` needs besides the input and positions.

    ``ext_factor`` is 1 under YaRN (0 otherwise), ``corr_dims`` are YaRN's ramp limits (pair
    indices), ``mscale`` multiplies cos and sin (llama.cpp's ``attn_factor`` argument).
    """

    n_rot: int
    style: str
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    corr_dims: tuple[float, float] = (0.0, 0.0)
    mscale: float = 1.0


def yarn_corr_dims(
    n_rot: int, n_ctx_orig: int, freq_base: float, beta_fast: float = 32.0, beta_slow: float = 1.0
) -> tuple[float, float]:
    """YaRN's ramp limits: the pair indices whose wavelength spans ``n_ctx_orig / beta``."""

    def dim(beta: float) -> float:
        return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(freq_base))

    return max(0.0, math.floor(dim(beta_fast))), min(n_rot - 1.0, math.ceil(dim(beta_slow)))


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    params: RopeParams | None = None,
    *,
    freq_factors: np.ndarray | None = None,
    **kw: Any,
) -> np.ndarray:
    """Rotary embedding of ``x[T, H, D]`` on its first ``n_rot`` dims (llama.cpp semantics).

    Pair ``i`` turns by ``pos * base^(-2i/n_rot)`` (divided by ``freq_factors[i]``), scaled by
    ``freq_scale``; under YaRN the scaled and unscaled angles are mixed by a linear ramp over
    ``corr_dims`` (unscaled below, scaled above). ``params`` or its fields as keywords.
    """
    p = params if params is not None else RopeParams(**kw)
    n_rot = p.n_rot
    if n_rot % 2 or n_rot > x.shape[-1]:
        raise UnsupportedModelError(f"n_rot={n_rot} must be even and <= head dim {x.shape[-1]}")
    half = n_rot // 2
    pair = np.arange(half, dtype=np.float64)
    inv_freq = p.freq_base ** (-2.0 * pair / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)[:half]
    extrap = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq  # [T, half]
    theta = p.freq_scale * extrap
    mscale = p.mscale
    if p.ext_factor != 0.0:
        low, high = p.corr_dims
        ramp = (1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)) * p.ext_factor
        theta = theta * (1.0 - ramp) + extrap * ramp
        mscale *= 1.0 + 0.1 * math.log(1.0 / p.freq_scale)
    cos = (np.cos(theta) * mscale)[:, None, :]
    sin = (np.sin(theta) * mscale)[:, None, :]
    out = np.array(x, dtype=np.float64, copy=True)
    if p.style == ROPE_NORM:
        a = x[..., 0:n_rot:2]
        b = x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    elif p.style == ROPE_NEOX:
        a = x[..., :half]
        b = x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        raise UnsupportedModelError(f"unknown RoPE style {p.style!r}")
    return out


def causal_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    window: int = 0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """``softmax(q kᵀ · scale + causal mask) v`` per head with GQA broadcast; with ``window``
    > 0 query ``i`` sees keys ``j`` with ``i - window < j <= i`` only (llama.cpp's standard
    sliding window). ``sinks`` ``[Hq]``: one logit per query head that joins every row's
    softmax denominator as a key of value zero (gpt-oss; ggml's ``soft_max_add_sinks``).

    q ``[T, Hq, Dk]``, k ``[T, Hkv, Dk]``, v ``[T, Hkv, Dv]`` → ``[T, Hq * Dv]``.
    Query head ``h`` reads kv head ``h // (Hq // Hkv)``.
    """
    t, n_head, _ = q.shape
    n_head_kv = k.shape[1]
    if n_head % n_head_kv:
        raise UnsupportedModelError(f"n_head={n_head} is not a multiple of n_head_kv={n_head_kv}")
    group = n_head // n_head_kv
    kv_of = np.arange(n_head) // group
    kh = k[:, kv_of, :].transpose(1, 2, 0)  # [H, Dk, T]
    vh = v[:, kv_of, :].transpose(1, 0, 2)  # [H, T, Dv]
    scores = np.matmul(q.transpose(1, 0, 2), kh) * scale  # [H, T, T]
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    if window > 0:
        future |= np.tril(np.ones((t, t), dtype=bool), k=-window)
    scores[:, future] = -np.inf
    if sinks is None:
        probs = softmax(scores, axis=-1)
    else:
        sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (n_head, t, 1))
        probs = softmax(np.concatenate([scores, sink], axis=-1), axis=-1)[..., :t]
    out = np.matmul(probs, vh)  # [H, T, Dv]
    return out.transpose(1, 0, 2).reshape(t, -1)


def route(
    router_logits: np.ndarray,
    n_used: int,
    *,
    gating: int,
    normalize: bool,
    scale: float,
    selection_bias: np.ndarray | None = None,
    n_groups: int = 0,
    n_groups_used: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's expert selection: returns ``(experts [T, k] int, weights [T, k] float64)``."""
    logits = np.asarray(router_logits, dtype=np.float64)
    if gating == GATING_SOFTMAX:
        probs = softmax(logits)
    elif gating == GATING_SIGMOID:
        probs = 1.0 / (1.0 + np.exp(-logits))
    elif gating == GATING_SOFTMAX_WEIGHT:
        probs = logits
    elif gating == GATING_SQRT_SOFTPLUS:
        probs = np.sqrt(np.logaddexp(0.0, logits))
    else:
        raise UnsupportedModelError(f"expert gating function {gating} is not supported")
    select = probs if selection_bias is None else probs + selection_bias
    n_tokens, n_expert = select.shape
    if n_groups > 1:
        per_group = n_expert // n_groups
        grouped = select.reshape(n_tokens, n_groups, per_group)
        top2 = -np.sort(-grouped, axis=-1)[..., :2]
        group_score = top2.sum(axis=-1)  # [T, n_groups]
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :n_groups_used]
        mask = np.ones((n_tokens, n_groups), dtype=bool)
        np.put_along_axis(mask, keep, False, axis=-1)
        grouped = np.where(mask[..., None], -np.inf, grouped)
        select = grouped.reshape(n_tokens, n_expert)
    experts = np.argsort(-select, axis=-1, kind="stable")[:, :n_used]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if gating == GATING_SOFTMAX_WEIGHT:
        weights = softmax(weights)
    if normalize:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), 6.103515625e-5)
    if scale not in (0.0, 1.0):
        weights = weights * scale
    return experts, weights


def moe_ffn(
    x: np.ndarray,
    experts: np.ndarray,
    weights: np.ndarray,
    gate_exps: np.ndarray,
    up_exps: np.ndarray,
    down_exps: np.ndarray,
    glu: str = "swiglu",
    biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Sum over routes of ``weight · down_e(act(gate_e x) * up_e x)``, ``act`` silu
    (``glu="swiglu"``) or relu (``"reglu"``); ``"swiglu_oai"``: `swiglu_oai` of the two.
    ``biases`` (gate ``[E, ff]``, up ``[E, ff]``, down ``[E, d]``): each expert's projections
    add their bias rows (gpt-oss), the down bias before the route's weight.

    ``gate_exps``/``up_exps`` are ``[E, ff, d]``, ``down_exps`` ``[E, d, ff]`` (numpy order of the
    GGUF tensors), or anything indexable by expert id the same way (the model passes lazy
    views that dequantize one expert at a time). Each expert runs once on its routed rows.
    """
    out = np.zeros((x.shape[0], down_exps[int(experts.flat[0])].shape[0]), dtype=np.float64)
    for e in np.unique(experts):
        rows, slots = np.nonzero(experts == e)
        xe = x[rows]
        g = xe @ gate_exps[e].T
        u = xe @ up_exps[e].T
        if biases is not None:
            g, u = g + biases[0][e], u + biases[1][e]
        if glu == "swiglu_oai":
            h = swiglu_oai(g, u)
        else:
            h = (silu(g) if glu == "swiglu" else np.maximum(g, 0.0)) * u
        y = h @ down_exps[e].T
        if biases is not None:
            y = y + biases[2][e]
        np.add.at(out, rows, y * weights[rows, slots][:, None])
    return out


def dense_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def causal_short_conv(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution: ``out[t, c] = sum_j kernel[c, j] * x[t - (L-1) + j, c]``.

    ``kernel`` is ``[d, L]``; positions before 0 are zero (an empty recurrent state), as
    ``ggml_ssm_conv`` on a fresh sequence.
    """
    t = x.shape[0]
    length = kernel.shape[1]
    padded = np.concatenate([np.zeros((length - 1, x.shape[1])), x], axis=0)
    out = np.zeros_like(x)
    for j in range(length):
        out += padded[j : j + t] * kernel[:, j]
    return out


# --------------------------------------------------------------------------------------------
# Reading the GGUF
# --------------------------------------------------------------------------------------------


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, list):
        return [v.item() if isinstance(v, np.generic) else v for v in value]
    return value.item() if isinstance(value, np.generic) else value


@attrs.frozen
class ReferenceConfig:
    """The hyper-parameters the forward pass needs, read from GGUF metadata as llama.cpp does."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    rms_eps: float
    rope_style: str
    freq_base: float
    freq_scale: float
    n_expert: int
    n_expert_used: int
    gating: int
    normalize_weights: bool
    weights_scale: float
    n_layer_dense_lead: int = 0
    n_expert_groups: int = 0
    n_group_used: int = 0
    # DeepSeek-2 MLA
    kv_lora_rank: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0
    # RoPE scaling: "none" | "linear" | "yarn"
    rope_scaling: str = "linear"
    n_ctx_orig: int = 0
    rope_attn_factor: float = 1.0
    yarn_log_mul: float = 0.0  # DeepSeek-2 only, already divided by 0.1 as llama.cpp does
    # SmallThinker: sliding window, the layers that slide and those without RoPE
    n_swa: int = 0
    swa_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()

    @property
    def attn_factor(self) -> float:
        """llama.cpp's ``cparams.yarn_attn_factor`` (``llama_context`` constructor)."""
        factor = 1.0
        if self.rope_scaling == "yarn":
            scale = 1.0 / self.freq_scale

            def get_mscale(m: float) -> float:
                return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0

            if self.yarn_log_mul != 0.0:
                m = self.yarn_log_mul if self.arch == "deepseek2" else 1.0
                factor = get_mscale(m) / get_mscale(self.yarn_log_mul)
            else:
                factor = get_mscale(1.0)
            factor /= 1.0 + 0.1 * math.log(scale)
        return factor * self.rope_attn_factor

    def rope_params(self, n_rot: int | None = None) -> RopeParams:
        n_rot = self.n_rot if n_rot is None else n_rot
        yarn = self.rope_scaling == "yarn"
        return RopeParams(
            n_rot=n_rot,
            style=self.rope_style,
            freq_base=self.freq_base,
            freq_scale=self.freq_scale,
            ext_factor=1.0 if yarn else 0.0,
            corr_dims=yarn_corr_dims(n_rot, self.n_ctx_orig, self.freq_base) if yarn else (0, 0),
            mscale=self.attn_factor,
        )

    @property
    def mla_kq_scale(self) -> float:
        """DeepSeek-2's attention scale: YaRN mscale² / sqrt(key_length_mla)."""
        log_inv = math.log(1.0 / self.freq_scale)
        attn_org = self.attn_factor * (1.0 + 0.1 * log_inv)
        mscale = attn_org * (1.0 + 0.1 * self.yarn_log_mul * log_inv)
        return mscale * mscale / math.sqrt(self.head_dim_k_mla)

    @classmethod
    def from_reader(cls, reader: GGUFReader) -> ReferenceConfig:
        fields = {name: _field_value(f) for name, f in reader.fields.items() if f.types}
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported by the reference "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def get(key: str, default: Any = None) -> Any:
            full = f"{arch}.{key}"
            if full in fields:
                return fields[full]
            if default is None:
                raise UnsupportedModelError(f"GGUF metadata key {full!r} is missing")
            return default

        n_layer = int(get("block_count"))

        def per_layer(value: Any) -> tuple[int, ...]:
            if isinstance(value, list):
                if len(value) != n_layer:
                    raise UnsupportedModelError(f"per-layer array of {len(value)} != {n_layer}")
                return tuple(int(v) for v in value)
            return (int(value),) * n_layer

        n_embd = int(get("embedding_length"))
        n_head = per_layer(get("attention.head_count"))
        has_kv = f"{arch}.attention.head_count_kv" in fields
        n_head_kv = per_layer(get("attention.head_count_kv")) if has_kv else n_head
        n_head_max = max(n_head)
        head_dim_k = int(get("attention.key_length", n_embd // n_head_max))
        head_dim_v = int(get("attention.value_length", n_embd // n_head_max))
        n_rot = int(get("rope.dimension_count", head_dim_k))
        scaling_type = str(get("rope.scaling.type", "linear"))
        factor = float(get("rope.scaling.factor", 0.0))
        if scaling_type not in ("none", "linear", "yarn"):
            raise UnsupportedModelError(
                f"RoPE scaling {scaling_type!r} is not implemented in the reference"
            )
        # llama.cpp: scale = 1/factor, and never any scaling when the type is "none".
        freq_scale = 1.0 if factor == 0.0 or scaling_type == "none" else 1.0 / factor
        window_key = f"{arch}.attention.sliding_window"
        extra: dict[str, Any] = {}
        if arch == "smallthinker":
            if int(fields.get(window_key, 0)) > 0:
                period = int(get("attention.sliding_window_pattern", 4))
                extra["n_swa"] = SMALLTHINKER_SWA
                extra["swa_layers"] = tuple(i for i in range(n_layer) if i % period)
                # llama.cpp: use_rope = (step == n_layer) || (i % step != 0)
                if n_layer != SMALLTHINKER_NOPE_STEP:
                    extra["nope_layers"] = tuple(range(0, n_layer, SMALLTHINKER_NOPE_STEP))
        elif arch == "gpt-oss":
            extra["n_swa"] = int(get("attention.sliding_window"))
            extra["swa_layers"] = tuple(
                i for i in range(n_layer) if i % GPT_OSS_SWA_PATTERN < GPT_OSS_SWA_PATTERN - 1
            )
        elif window_key in fields:
            raise UnsupportedModelError("sliding-window attention is not implemented")

        tensor_names = {t.name for t in reader.tensors}
        if "token_embd.weight" not in tensor_names:
            raise UnsupportedModelError("token_embd.weight is missing")
        n_vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[1])

        # Routing rules per architecture, as llama.cpp's graph builders hard-code them.
        gating, normalize, scale = GATING_SOFTMAX, True, 1.0
        if arch == "olmoe":
            normalize = False
        elif arch == "deepseek2":
            gating = int(get("expert_gating_func", GATING_NONE)) or GATING_SOFTMAX
            normalize = bool(get("expert_weights_norm", False))
            scale = float(get("expert_weights_scale", 0.0))
        elif arch in ("lfm2moe", "smallthinker"):
            gating = int(get("expert_gating_func"))
        elif arch == "gpt-oss":  # softmax over the selected logits, no renormalisation
            gating, normalize = GATING_SOFTMAX_WEIGHT, False
        if arch == "deepseek2":
            extra["kv_lora_rank"] = int(get("attention.kv_lora_rank"))
            k_mla = int(get("attention.key_length_mla", 0))
            v_mla = int(get("attention.value_length_mla", 0))
            extra["head_dim_k_mla"] = k_mla or head_dim_k
            extra["head_dim_v_mla"] = v_mla or head_dim_v
            extra["yarn_log_mul"] = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        return cls(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_rot=n_rot,
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_style=_ROPE_STYLE[arch],
            freq_base=float(get("rope.freq_base", 10000.0)),
            freq_scale=freq_scale,
            n_expert=int(get("expert_count", 0)),
            n_expert_used=int(max(per_layer(get("expert_used_count", 0)))),
            gating=gating,
            normalize_weights=normalize,
            weights_scale=scale,
            n_layer_dense_lead=int(get("leading_dense_block_count", 0)),
            n_expert_groups=int(get("expert_group_count", 0)),
            n_group_used=int(get("expert_group_used_count", 0)),
            rope_scaling=scaling_type,
            n_ctx_orig=int(get("rope.scaling.original_context_length", 0))
            or int(get("context_length")),
            rope_attn_factor=float(get("rope.scaling.attn_factor", 1.0)),
            **extra,
        )


class ReferenceModel:
    """A GGUF opened for the reference forward pass. Tensors are dequantized on demand."""

    def __init__(self, gguf_path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(gguf_path)
        self.reader = GGUFReader(self.path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = ReferenceConfig.from_reader(self.reader)
        if self.config.arch == "llama" and self.config.n_expert == 0:
            raise UnsupportedModelError("a `llama` GGUF without experts is not an MoE model")

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        """The named tensor dequantized to float64, in numpy order (GGUF ``ne`` reversed)."""
        try:
            t = self._tensors[name]
        except KeyError:
            raise UnsupportedModelError(f"tensor {name!r} is missing from {self.path}") from None
        values = dequantize(np.asarray(t.data), t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        return np.asarray(values, dtype=np.float64).reshape(shape)

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of a 2-D tensor, dequantizing only those rows (embedding lookup)."""
        t = self._tensors[name]
        picked = np.asarray(t.data)[np.asarray(ids)]
        values = dequantize(picked, t.tensor_type)
        return np.asarray(values, dtype=np.float64).reshape(len(ids), int(t.shape[0]))

    def opt(self, name: str) -> np.ndarray | None:
        return self.tensor(name) if self.has(name) else None

    @cached_property
    def _freq_factors(self) -> np.ndarray | None:
        return self.opt("rope_freqs.weight")

    # ---- the forward pass --------------------------------------------------------------

    def forward(
        self, tokens: Sequence[int], *, return_hidden: bool = False
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= cfg.n_vocab:
            raise ValueError(f"token ids must lie in [0, {cfg.n_vocab})")
        positions = np.arange(ids.size)
        x = self.rows("token_embd.weight", ids)
        for il in range(cfg.n_layer):
            x = self._layer(il, x, positions)
        norm_name = "token_embd_norm.weight" if cfg.arch == "lfm2moe" else "output_norm.weight"
        hidden = rms_norm(x, self.tensor(norm_name), cfg.rms_eps)
        head = "output.weight" if self.has("output.weight") else "token_embd.weight"
        logits = self._head(hidden, head)
        return (logits, hidden) if return_hidden else logits

    def _head(self, hidden: np.ndarray, name: str, chunk_rows: int = 8192) -> np.ndarray:
        """``hidden @ W.T`` with ``W`` dequantized a block of vocabulary rows at a time."""
        t = self._tensors[name]
        data = np.asarray(t.data)
        n_rows = int(t.shape[1])
        logits = np.empty((hidden.shape[0], n_rows), dtype=np.float64)
        for r0 in range(0, n_rows, chunk_rows):
            r1 = min(n_rows, r0 + chunk_rows)
            w = dequantize(data[r0:r1], t.tensor_type).astype(np.float64)
            logits[:, r0:r1] = hidden @ w.reshape(r1 - r0, -1).T
        return logits

    def experts(self, name: str) -> _LazyExperts:
        """A 3-D expert tensor as a per-expert view; ``[e]`` dequantizes expert ``e`` only."""
        t = self._tensors[name]
        if len(t.shape) != 3:
            raise UnsupportedModelError(f"{name} is not a 3-D expert tensor")
        return _LazyExperts(np.asarray(t.data), t.tensor_type, (int(t.shape[1]), int(t.shape[0])))

    def _layer(self, il: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cfg = self.config
        p = f"blk.{il}."
        # SmallThinker's router reads the layer's input, before the attention norm
        router_in = x if cfg.arch == "smallthinker" else None
        h = rms_norm(x, self.tensor(p + "attn_norm.weight"), cfg.rms_eps)
        if cfg.arch == "deepseek2":
            mixed = self._mla_attention(il, h, positions)
        elif cfg.arch == "lfm2moe" and cfg.n_head_kv[il] == 0:
            mixed = self._short_conv(il, h)
        else:
            mixed = self._attention(il, h, positions)
        x = x + mixed
        # gpt-oss: the experts read post_attention_norm of the residual (it has no ffn_norm)
        ffn_norm = "post_attention_norm" if cfg.arch == "gpt-oss" else "ffn_norm"
        h = rms_norm(x, self.tensor(p + ffn_norm + ".weight"), cfg.rms_eps)
        return x + self._ffn(il, h, router_in)

    def _attention(self, il: int, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cfg = self.config
        p = f"blk.{il}."
        t = h.shape[0]
        n_head, n_head_kv, dk, dv = (
            cfg.n_head[il],
            cfg.n_head_kv[il],
            cfg.head_dim_k,
            cfg.head_dim_v,
        )
        if self.has(p + "attn_qkv.weight"):
            qkv = h @ self.tensor(p + "attn_qkv.weight").T
            q, k, v = np.split(qkv, [n_head * dk, n_head * dk + n_head_kv * dk], axis=1)
        else:
            q = h @ self.tensor(p + "attn_q.weight").T
            k = h @ self.tensor(p + "attn_k.weight").T
            v = h @ self.tensor(p + "attn_v.weight").T
        q, k, v = (
            x if (b := self.opt(p + f"attn_{n}.bias")) is None else x + b
            for n, x in (("q", q), ("k", k), ("v", v))
        )
        q_norm = self.opt(p + "attn_q_norm.weight")
        k_norm = self.opt(p + "attn_k_norm.weight")
        if cfg.arch == "olmoe":
            # OLMoE: RMSNorm over the whole projection, before the head split.
            q = rms_norm(q, q_norm, cfg.rms_eps)
            k = rms_norm(k, k_norm, cfg.rms_eps)
        q = q.reshape(t, n_head, dk)
        k = k.reshape(t, n_head_kv, dk)
        v = v.reshape(t, n_head_kv, dv)
        if cfg.arch in ("qwen3moe", "lfm2moe"):
            # Per-head RMSNorm over head_dim.
            q = rms_norm(q, q_norm, cfg.rms_eps)
            k = rms_norm(k, k_norm, cfg.rms_eps)
        if il not in cfg.nope_layers:
            rp = cfg.rope_params()
            q = rope(q, positions, rp, freq_factors=self._freq_factors)
            k = rope(k, positions, rp, freq_factors=self._freq_factors)
        window = cfg.n_swa if il in cfg.swa_layers else 0
        sinks = self.opt(p + "attn_sinks.weight")
        attn = causal_attention(q, k, v, 1.0 / math.sqrt(dk), window, sinks)
        out = attn @ self.tensor(p + "attn_output.weight").T
        bias = self.opt(p + "attn_output.bias")
        return out if bias is None else out + bias

    def _mla_attention(self, il: int, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """DeepSeek-2 multi-head latent attention, computed in its expanded (MHA) form."""
        cfg = self.config
        p = f"blk.{il}."
        t = h.shape[0]
        n_head = cfg.n_head[il]
        d_rope = cfg.n_rot
        dk = cfg.head_dim_k_mla
        dv = cfg.head_dim_v_mla
        d_nope = dk - d_rope
        rank = cfg.kv_lora_rank
        if self.has(p + "attn_q_a.weight"):
            qa = rms_norm(
                h @ self.tensor(p + "attn_q_a.weight").T,
                self.tensor(p + "attn_q_a_norm.weight"),
                cfg.rms_eps,
            )
            q = qa @ self.tensor(p + "attn_q_b.weight").T
        else:
            q = h @ self.tensor(p + "attn_q.weight").T
        q = q.reshape(t, n_head, dk)
        kv_a = h @ self.tensor(p + "attn_kv_a_mqa.weight").T  # [T, rank + d_rope]
        latent = rms_norm(kv_a[:, :rank], self.tensor(p + "attn_kv_a_norm.weight"), cfg.rms_eps)
        rp = cfg.rope_params(d_rope)
        k_pe = rope(kv_a[:, None, rank:], positions, rp)  # [T, 1, d_rope]
        q_pe = rope(q[:, :, d_nope:], positions, rp)
        if self.has(p + "attn_kv_b.weight"):
            kv = (latent @ self.tensor(p + "attn_kv_b.weight").T).reshape(t, n_head, d_nope + dv)
            k_nope, v = kv[..., :d_nope], kv[..., d_nope:]
        else:
            # Split form: attn_k_b [H, rank, d_nope] (k_nope = W_kᵀ-stored), attn_v_b [H, dv, rank].
            wk = self.tensor(p + "attn_k_b.weight").reshape(n_head, rank, d_nope)
            wv = self.tensor(p + "attn_v_b.weight").reshape(n_head, dv, rank)
            k_nope = np.einsum("tr,hrn->thn", latent, wk)
            v = np.einsum("tr,hvr->thv", latent, wv)
        qf = np.concatenate([q[..., :d_nope], q_pe], axis=-1)
        kf = np.concatenate([k_nope, np.broadcast_to(k_pe, (t, n_head, d_rope))], axis=-1)
        attn = causal_attention(qf, kf, v, cfg.mla_kq_scale)
        return attn @ self.tensor(p + "attn_output.weight").T

    def _short_conv(self, il: int, h: np.ndarray) -> np.ndarray:
        """LFM2 gated short convolution: ``out_proj(C * conv(B * x))``."""
        p = f"blk.{il}."
        bcx = h @ self.tensor(p + "shortconv.in_proj.weight").T
        b, c, xx = np.split(bcx, 3, axis=1)
        kernel = self.tensor(p + "shortconv.conv.weight")  # [d, L]
        y = c * causal_short_conv(b * xx, kernel)
        return y @ self.tensor(p + "shortconv.out_proj.weight").T

    def _ffn(self, il: int, h: np.ndarray, router_in: np.ndarray | None = None) -> np.ndarray:
        cfg = self.config
        p = f"blk.{il}."
        if not self.has(p + "ffn_gate_inp.weight"):
            return dense_ffn(
                h,
                self.tensor(p + "ffn_gate.weight"),
                self.tensor(p + "ffn_up.weight"),
                self.tensor(p + "ffn_down.weight"),
            )
        logits = (h if router_in is None else router_in) @ self.tensor(p + "ffn_gate_inp.weight").T
        router_bias = self.opt(p + "ffn_gate_inp.bias")  # gpt-oss: added to the logits
        if router_bias is not None:
            logits = logits + router_bias
        experts, weights = route(
            logits,
            cfg.n_expert_used,
            gating=cfg.gating,
            normalize=cfg.normalize_weights,
            scale=cfg.weights_scale,
            selection_bias=self.opt(p + "exp_probs_b.bias"),
            n_groups=cfg.n_expert_groups,
            n_groups_used=cfg.n_group_used,
        )
        gate: Any
        up: Any
        if self.has(p + "ffn_gate_up_exps.weight"):
            gate, up = np.split(self.tensor(p + "ffn_gate_up_exps.weight"), 2, axis=1)
        else:
            gate = self.experts(p + "ffn_gate_exps.weight")
            up = self.experts(p + "ffn_up_exps.weight")
        down = self.experts(p + "ffn_down_exps.weight")
        glu = {"smallthinker": "reglu", "gpt-oss": "swiglu_oai"}.get(cfg.arch, "swiglu")
        biases = None
        if self.has(p + "ffn_down_exps.bias"):
            biases = (
                self.tensor(p + "ffn_gate_exps.bias"),
                self.tensor(p + "ffn_up_exps.bias"),
                self.tensor(p + "ffn_down_exps.bias"),
            )
        out = moe_ffn(h, experts, weights, gate, up, down, glu, biases)
        if self.has(p + "ffn_gate_shexp.weight"):
            out = out + dense_ffn(
                h,
                self.tensor(p + "ffn_gate_shexp.weight"),
                self.tensor(p + "ffn_up_shexp.weight"),
                self.tensor(p + "ffn_down_shexp.weight"),
            )
        return out


class _LazyExperts:
    """``view[e]`` → expert ``e`` of a GGUF 3-D tensor, dequantized to float64 on access."""

    def __init__(self, data: np.ndarray, qtype: Any, shape: tuple[int, int]) -> None:
        self._data, self._qtype, self._shape = data, qtype, shape

    def __getitem__(self, e: int) -> np.ndarray:
        values = dequantize(self._data[int(e)], self._qtype)
        return np.asarray(values, dtype=np.float64).reshape(self._shape)


def reference_forward(
    gguf_path: str | os.PathLike[str], tokens: Sequence[int], *, return_hidden: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """All-position logits ``[T, n_vocab]`` (float64) of the GGUF model on ``tokens``.

    With ``return_hidden=True`` returns ``(logits, hidden)`` where ``hidden`` is the final
    normed hidden state ``[T, n_embd]`` (what the output head multiplies).
    """
    return ReferenceModel(gguf_path).forward(tokens, return_hidden=return_hidden)
