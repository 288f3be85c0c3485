"""DeepSeek-V2 (llama.cpp `deepseek2`): multi-head latent attention (MLA, stored as MQA: one KV
head of `kv_lora_rank + rope` width), adjacent-pair RoPE (YaRN-scaled in the published
models), leading dense layers, then routed experts plus always-on shared experts
(`ffn_*_shexp`, `expert_shared_count` experts wide). Gating, renormalisation and weight scale
come from the file (`expert_gating_func` softmax when absent)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType, Keys

from . import Family, KeyList
from ._plan import Plan, Want

__all__ = ["FAMILY"]

U32, F32v, BOOL, STR = (
    GGUFValueType.UINT32,
    GGUFValueType.FLOAT32,
    GGUFValueType.BOOL,
    GGUFValueType.STRING,
)


def _layer(want: Want, i: int) -> None:
    """MLA in either of its forms (q LoRA or not; `attn_kv_b` or its per-head split, the form
    present decides), then a dense FFN or the router with the shared experts."""
    s, p, w = want.spec, f"blk.{i}.", want.required
    d, nh = s.n_embd, s.n_head
    k, v, rope = s.head_dim_k_mla, s.head_dim_v_mla, s.rope_dims
    want.norms(i)
    if p + "attn_q.weight" in want.shapes:
        w[p + "attn_q.weight"] = (nh * k, d)
    else:
        w[p + "attn_q_a.weight"] = (s.q_lora_rank, d)
        w[p + "attn_q_a_norm.weight"] = (s.q_lora_rank,)
        w[p + "attn_q_b.weight"] = (nh * k, s.q_lora_rank)
    w[p + "attn_kv_a_mqa.weight"] = (s.kv_lora_rank + rope, d)
    w[p + "attn_kv_a_norm.weight"] = (s.kv_lora_rank,)
    if p + "attn_kv_b.weight" in want.shapes:
        w[p + "attn_kv_b.weight"] = (nh * (k - rope + v), s.kv_lora_rank)
    else:
        w[p + "attn_k_b.weight"] = (nh, s.kv_lora_rank, k - rope)
        w[p + "attn_v_b.weight"] = (nh, v, s.kv_lora_rank)
    w[p + "attn_output.weight"] = (d, nh * v)
    want.ffn_or_moe(i)


def _synth_layer(plan: Plan, i: int) -> None:
    d, p = plan.d, f"blk.{i}."
    ne, nh = d.n_embd, d.n_head
    k_mla = d.qk_nope_dim + d.qk_rope_dim
    plan.norm(p + "attn_norm.weight", ne)
    if d.q_lora_rank > 0:
        plan.matrix(p + "attn_q_a.weight", d.q_lora_rank, ne)
        plan.norm(p + "attn_q_a_norm.weight", d.q_lora_rank)
        plan.matrix(p + "attn_q_b.weight", nh * k_mla, d.q_lora_rank)
    else:
        plan.matrix(p + "attn_q.weight", nh * k_mla, ne)
    plan.matrix(p + "attn_kv_a_mqa.weight", d.kv_lora_rank + d.qk_rope_dim, ne)
    plan.norm(p + "attn_kv_a_norm.weight", d.kv_lora_rank)
    # MLA up-projections split per head, as current convert_hf_to_gguf writes them:
    # attn_k_b ne {nope, kv_lora, n_head}, attn_v_b ne {kv_lora, v_head, n_head}
    plan.add(p + "attn_k_b.weight", (nh, d.kv_lora_rank, d.qk_nope_dim), plan.dense_type, "matrix")
    plan.add(p + "attn_v_b.weight", (nh, d.v_head_dim, d.kv_lora_rank), plan.dense_type, "matrix")
    plan.matrix(p + "attn_output.weight", ne, nh * d.v_head_dim, 0.5)
    plan.norm(p + "ffn_norm.weight", ne)
    if i < d.n_leading_dense:
        plan.dense_ffn(i, d.n_ff)
    else:
        plan.experts(i)
        plan.dense_ffn(i, d.n_ff_exp * d.n_shared_experts, "_shexp")


def _keys(d: Any) -> KeyList:
    out: KeyList = [
        (Keys.LLM.FEED_FORWARD_LENGTH, d.n_ff, U32),
        (Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, d.n_ff_exp, U32),
        (Keys.LLM.LEADING_DENSE_BLOCK_COUNT, d.n_leading_dense, U32),
        (Keys.LLM.EXPERT_SHARED_COUNT, d.n_shared_experts, U32),
        (Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0, F32v),
        (Keys.LLM.EXPERT_WEIGHTS_NORM, False, BOOL),
        (Keys.LLM.EXPERT_GATING_FUNC, 1, U32),  # softmax
        (Keys.Attention.HEAD_COUNT_KV, 1, U32),  # MLA is stored as MQA
        (Keys.Attention.KV_LORA_RANK, d.kv_lora_rank, U32),
        (Keys.Attention.KEY_LENGTH, d.kv_lora_rank + d.qk_rope_dim, U32),
        (Keys.Attention.VALUE_LENGTH, d.kv_lora_rank, U32),
        (Keys.Attention.KEY_LENGTH_MLA, d.qk_nope_dim + d.qk_rope_dim, U32),
        (Keys.Attention.VALUE_LENGTH_MLA, d.v_head_dim, U32),
        (Keys.Rope.DIMENSION_COUNT, d.qk_rope_dim, U32),
    ]
    if d.q_lora_rank > 0:
        out.append((Keys.Attention.Q_LORA_RANK, d.q_lora_rank, U32))
    if d.yarn_factor > 0:  # as convert_hf_to_gguf writes DeepSeek-V2's rope_scaling
        out += [
            (Keys.Rope.SCALING_TYPE, "yarn", STR),
            (Keys.Rope.SCALING_FACTOR, d.yarn_factor, F32v),
            ("{arch}.rope.scaling.original_context_length", d.yarn_orig_ctx, U32),
            ("{arch}.rope.scaling.yarn_log_multiplier", d.yarn_log_mul, F32v),
        ]
    return out


FAMILY = Family(
    name="deepseek2",
    gguf_arch="deepseek2",
    rope_type="norm",
    qk_norm="none",
    norm_topk=None,  # expert_weights_norm
    gating_key="optional",  # absent in the first DeepSeek-V2 GGUFs: softmax
    leading_dense=True,
    attention="mla",
    conv_layers=False,
    shared_experts=True,
    final_norm="output_norm.weight",
    layer_tensors=_layer,
    check=None,
    rope_base=10000.0,
    rms_eps=1e-5,
    vocab="ggml-vocab-deepseek-llm.gguf",
    presets={
        # DeepSeek-V2's YaRN (factor 40, mscale_all_dim 0.707) with an original context short
        # enough that the ramp splits the rotated pairs
        "tiny": {"n_layers": 3, "yarn_factor": 40.0},
        "small": {"yarn_factor": 40.0},
        # deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers (first_k_dense_replace 1), hidden
        # 2048, intermediate 10944 (the dense layer), 16 heads, q_lora_rank null, kv_lora_rank
        # 512, qk_nope 128 / qk_rope 64 / v_head 128, 64 routed experts top-6 of
        # moe_intermediate_size 1408 + 2 shared, vocab 102400, rope_theta 10000, YaRN factor 40
        # over original_max_position_embeddings 4096 (max 163840), mscale_all_dim 0.707.
        "deepseek-v2-lite": dict(
            n_layers=27,
            n_embd=2048,
            n_ff_exp=1408,
            n_ff=10944,
            n_experts=64,
            n_experts_used=6,
            n_head=16,
            n_head_kv=16,
            head_dim=128,
            n_vocab=102400,
            n_ctx=163840,
            n_shared_experts=2,
            n_leading_dense=1,
            q_lora_rank=0,
            kv_lora_rank=512,
            qk_rope_dim=64,
            qk_nope_dim=128,
            v_head_dim=128,
            yarn_factor=40.0,
            yarn_orig_ctx=4096,
            yarn_log_mul=0.0707,
        ),
    },
    published=("deepseek-v2-lite",),
    synth_layer=_synth_layer,
    synth_keys=_keys,
)
