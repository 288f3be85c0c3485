"""DeepSeek-V2 (llama.cpp `deepseek2`): multi-head latent attention (MLA), leading dense
SwiGLU layers, then routed experts plus always-on shared experts.

Read next to llama.cpp's ``src/models/deepseek2.cpp``. Per layer:

* **MLA.** ``q`` comes from ``attn_q`` or, with a q LoRA, ``attn_q_b(rms_norm(attn_q_a x))``;
  each head is ``[nope | rope]``. ``attn_kv_a_mqa`` gives the compressed KV (``kv_lora_rank``
  wide, RMS-normed by ``attn_kv_a_norm``) and one RoPE key shared by all heads. RoPE (with
  YaRN) touches only the rope part of q and k.
* **Decompressed for prefill.** The latent is expanded per head into ``k_nope`` (``attn_k_b``)
  and ``v`` (``attn_v_b``, or the older fused ``attn_kv_b``), and attention runs as ordinary
  multi-head attention with key dim ``nope + rope`` (192 for V2-Lite) and value dim ``v`` (128).
  llama.cpp instead *absorbs* ``attn_k_b`` into q and attends over the 576-wide latent, the
  right choice for decode (the KV cache holds the latent). For a prefill of T tokens the
  attention work is ``~T² · H · (dk + dv)``: 320 per head decompressed against 1088 absorbed,
  3.4x less, and the decompression itself is two small GEMMs linear in T. docs/design.md says
  more.
* **Attention scale** ``mscale² / sqrt(nope + rope)``, YaRN's magnitude correction moved out of
  RoPE into the scale exactly as llama.cpp does.
* **FFN.** The first ``leading_dense_block_count`` layers are a dense SwiGLU (no expert phase:
  nothing is read for them); the others add the routed experts (softmax or sigmoid gating, the
  optional selection bias ``exp_probs_b``, ``expert_weights_norm``/``scale``) and the shared
  experts (``ffn_*_shexp``, resident).

The heads are laid out ``[rope | nope]`` inside the engine: the dot product does not depend on
the order of dimensions as long as q and k agree, and the RoPE kernel rotates the leading
``n_rot`` dims of a head.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from estream_layout import ModelSpec

from ..errors import UnsupportedModelError
from ..packed import DenseTensor, PackedModel
from .ops import Ops
from .weights import (
    FFN,
    MoE,
    Rope,
    Weights,
    bind_ffn,
    bind_head,
    bind_moe,
    dequantize,
    yarn_log_mul,
)

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: bf16, whose error here is within 5 % of fp32 attention's on every parity row (32
#: prompts each: q4_0 ×0.999 of it, llama.cpp's Q4_0 ×1.007, Q4_K_M ×0.993, Q5_K_M ×1.000,
#: Q6_K ×1.001, Q8_0 ×1.010; docs/benchmarks.md, parity).
ATTENTION_AUTO = "bf16"

__all__ = ["ATTENTION_AUTO", "MLA", "Layer", "bind", "kq_scale", "layer", "mla_attention"]


@attrs.frozen
class MLA:
    """One layer's latent attention weights, in the orientation the prefill form multiplies.

    ``wk_b`` is ``attn_k_b`` transposed to ``[n_head * nope, kv_lora_rank]`` and ``wv_b`` is
    ``attn_v_b`` as ``[n_head * v, kv_lora_rank]`` (``wkv_b``, the older fused
    ``[n_head * (nope + v), kv_lora_rank]``, replaces both): each is then one GEMM of the
    latent."""

    wq: DenseTensor | None  # attn_q, when there is no q LoRA
    wq_a: DenseTensor | None
    q_a_norm: np.ndarray | None = attrs.field(eq=False)
    wq_b: DenseTensor | None
    wkv_a: DenseTensor  # attn_kv_a_mqa: [kv_lora_rank + rope, n_embd]
    kv_a_norm: np.ndarray = attrs.field(eq=False)
    wk_b: DenseTensor | None
    wv_b: DenseTensor | None
    wkv_b: DenseTensor | None
    wo: DenseTensor
    n_head: int
    rank: int
    d_nope: int
    d_rope: int
    d_v: int
    rope: Rope
    scale: float


@attrs.frozen
class Layer:
    attn_norm: np.ndarray = attrs.field(eq=False)
    attn: MLA
    ffn_norm: np.ndarray = attrs.field(eq=False)
    ffn: FFN | None  # a leading dense layer's FFN
    moe: MoE | None
    shared: FFN | None  # the shared experts of an MoE layer


def kq_scale(hp: ModelSpec) -> float:
    """llama.cpp's deepseek2 attention scale ``mscale² / sqrt(key_length_mla)``.

    ``mscale = attn_factor_org · (1 + 0.1 · m · ln(1/freq_scale))``, with
    ``attn_factor_org = rope attn_factor · (1 + 0.1 ln(1/freq_scale))`` undoing the cancellation
    `llama_context` applied to the RoPE factor (``m``: see `yarn_log_mul`). Without scaling it
    is ``1/sqrt(nope + rope)``."""
    log_inv = math.log(1.0 / hp.rope_freq_scale)
    rope = Rope.from_spec(hp)
    attn_org = rope.attn_factor * (1.0 + 0.1 * log_inv)
    mscale = attn_org * (1.0 + 0.1 * yarn_log_mul(hp) * log_inv)
    return mscale * mscale / math.sqrt(hp.head_dim_k_mla)


def _in_out(name: str, w_in_out: np.ndarray) -> DenseTensor:
    """An f32 matrix derived at bind, given as ``[in, out]``: stored so (`DenseTensor.in_out`),
    the layout the f32 matmul reads, so that no transposed copy of it is made."""
    a = np.ascontiguousarray(w_in_out, dtype=np.float32)
    return DenseTensor(name, "f32", a.shape[::-1], a.view(np.uint8).reshape(-1), in_out=True)


def _k_b_decompression(t: DenseTensor) -> DenseTensor:
    """``attn_k_b`` ``[H, rank, nope]`` (what absorption multiplies) -> ``[H*nope, rank]``.

    Kept in f32, exactly the packed values: re-quantizing the transpose would add a rounding
    step the reference does not have (V2-Lite: 4 MiB a layer). Stored ``[rank, H*nope]``
    (`_in_out`): one copy, where a ``[H*nope, rank]`` one needed a transposed second."""
    w = dequantize(t)
    h, rank, nope = w.shape
    return _in_out(t.name + "^T", w.transpose(1, 0, 2).reshape(rank, h * nope))


def _heads_as_rows(t: DenseTensor) -> DenseTensor:
    """A per-head stack ``[H, N, K]`` as one ``[H*N, K]`` matrix. Tiled bytes are reused as they
    are when ``N`` is a multiple of 32 (per-head tiles back to back are then the tiles of the
    stacked matrix); otherwise (tiny test shapes) dequantized to f32."""
    h, n, k = t.shape
    if t.fmt == "f32" or n % 32 == 0:
        return DenseTensor(t.name, t.fmt, (h * n, k), t.data)
    return _in_out(t.name, dequantize(t).reshape(h * n, k).T)


def _bind_mla(model: PackedModel, i: int) -> MLA:
    hp = model.hparams
    p = f"blk.{i}."
    d_rope = hp.rope_dims
    d_nope = hp.head_dim_k_mla - d_rope
    wq = wq_a = wq_b = q_a_norm = None
    if model.has(p + "attn_q.weight"):
        wq = model.dense(p + "attn_q.weight")
    else:
        wq_a = model.dense(p + "attn_q_a.weight")
        q_a_norm = model.dense(p + "attn_q_a_norm.weight").f32()
        wq_b = model.dense(p + "attn_q_b.weight")
    wk_b = wv_b = wkv_b = None
    if model.has(p + "attn_kv_b.weight"):  # early converters: one fused up-projection
        wkv_b = model.dense(p + "attn_kv_b.weight")
    else:
        wk_b = _k_b_decompression(model.dense(p + "attn_k_b.weight"))
        wv_b = _heads_as_rows(model.dense(p + "attn_v_b.weight"))
    return MLA(
        wq=wq,
        wq_a=wq_a,
        q_a_norm=q_a_norm,
        wq_b=wq_b,
        wkv_a=model.dense(p + "attn_kv_a_mqa.weight"),
        kv_a_norm=model.dense(p + "attn_kv_a_norm.weight").f32(),
        wk_b=wk_b,
        wv_b=wv_b,
        wkv_b=wkv_b,
        wo=model.dense(p + "attn_output.weight"),
        n_head=hp.n_head,
        rank=hp.kv_lora_rank,
        d_nope=d_nope,
        d_rope=d_rope,
        d_v=hp.head_dim_v_mla,
        rope=Rope.from_spec(hp, d_rope),
        scale=kq_scale(hp),
    )


def bind(model: PackedModel) -> Weights[Layer]:
    hp = model.hparams
    if hp.expert_group_count > 1:
        raise UnsupportedModelError(
            f"{model.path}: group-limited expert routing (expert_group_count = "
            f"{hp.expert_group_count}, DeepSeek-V2/V3 full size) is not implemented; "
            "DeepSeek-V2-Lite and other single-group models run"
        )
    layers = []
    for i in range(hp.n_layers):
        p = f"blk.{i}."
        moe = shared = ffn = None
        if i in model.layers:
            moe = bind_moe(model, i)
            if model.has(p + "ffn_gate_shexp.weight"):
                shared = bind_ffn(model, i, "_shexp")
        else:
            ffn = bind_ffn(model, i)
        layers.append(
            Layer(
                attn_norm=model.dense(p + "attn_norm.weight").f32(),
                attn=_bind_mla(model, i),
                ffn_norm=model.dense(p + "ffn_norm.weight").f32(),
                ffn=ffn,
                moe=moe,
                shared=shared,
            )
        )
    return Weights(bind_head(model), tuple(layers))


def mla_attention(ops: Ops, w: MLA, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Multi-head latent attention of the normed ``h [T, d]``, decompressed per head."""
    t, n_head, nope, rope = h.shape[0], w.n_head, w.d_nope, w.d_rope
    # q (or the q LoRA's down-projection) and the compressed KV share h: one op
    q, kv = ops.matmuls(h, (w.wq if w.wq is not None else w.wq_a, w.wkv_a), "attn_q_kv_a")  # type: ignore[arg-type]
    if w.wq is None:
        q = ops.matmul(ops.rms_norm(q, w.q_a_norm), w.wq_b, "attn_q_b")  # type: ignore[arg-type]
    # kv [T, rank + rope]: compressed KV | shared RoPE key
    latent = ops.rms_norm(ops.cols(kv, 0, w.rank), w.kv_a_norm)
    k_pe = ops.cols(kv, w.rank, w.rank + rope).reshape(t, 1, rope)
    if w.wkv_b is not None:
        kv_b = ops.matmul(latent, w.wkv_b, "attn_kv_b").reshape(t * n_head, nope + w.d_v)
        k_nope = kv_b[:, :nope]  # [T*H, nope], a view
        v = ops.cols(kv_b, nope, nope + w.d_v).reshape(t, n_head, w.d_v)
    else:
        k_nope = ops.matmul(latent, w.wk_b, "attn_kv_b").reshape(t * n_head, nope)  # type: ignore[arg-type]
        v = ops.matmul(latent, w.wv_b, "attn_kv_b").reshape(t, n_head, w.d_v)  # type: ignore[arg-type]
    # heads as [rope | nope], assembled by copy ops: rows are (token, head)
    width = rope + nope
    q2 = q.reshape(t * n_head, width)
    qh = ops.empty((t, n_head, width))
    kh = ops.empty((t, n_head, width))
    qh2, kh2 = qh.reshape(t * n_head, width), kh.reshape(t * n_head, width)
    ops.copy(q2[:, nope:], qh2[:, :rope])
    ops.copy(q2[:, :nope], qh2[:, rope:])
    ops.rope(qh, pos, w.rope)
    ops.rope(k_pe, pos, w.rope)
    ops.copy(k_pe.reshape(t, rope), kh2[:, :rope], rep=n_head)  # one RoPE key for every head
    ops.copy(k_nope, kh2[:, rope:])
    a = ops.attend(qh, kh, v, w.scale)  # [T, H, v]
    return ops.matmul(np.ascontiguousarray(a.reshape(t, -1)), w.wo, "attn_out")


def layer(ops: Ops, hp: ModelSpec, w: Layer, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    x = ops.add(x, mla_attention(ops, w.attn, ops.rms_norm(x, w.attn_norm), pos))
    h = ops.rms_norm(x, w.ffn_norm)
    if w.moe is None:
        return ops.add(x, ops.dense_ffn(h, w.ffn))  # type: ignore[arg-type]
    return ops.add(x, ops.moe(h, w.moe, shared=w.shared))
