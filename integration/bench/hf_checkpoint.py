"""Synthetic Hugging Face checkpoints for llama.cpp's own converter (``convert_hf_to_gguf.py``).

`write_checkpoint` writes a directory as the DeepSeek-V2 (``DeepseekV2ForCausalLM``), LFM2-MoE
(``Lfm2MoeForCausalLM``), gpt-oss (``GptOssForCausalLM``) and SmallThinker
(``SmallThinkerForCausalLM``) releases lay it out — ``config.json`` with the published field
names, ``model.safetensors`` with the Hugging Face tensor names and shapes (one tensor per expert,
``kv_b_proj`` fused, the depthwise ``conv.conv`` kernel as ``[d, 1, L]``; gpt-oss's experts as
one ``[E, in, out]`` tensor per projection with ``gate`` and ``up`` interleaved in
``gate_up_proj``), a byte-level BPE ``tokenizer.json`` — filled with Gaussian F32 weights at the
scales estream-synth uses. ``mxfp4=True`` (gpt-oss only) stores the expert matrices as the
published gpt-oss checkpoints do: MXFP4 ``*_blocks`` (``[E, out, in/32, 16]`` bytes, two FP4
E2M1 codes a byte, the even element in the low nibble) and ``*_scales`` (``[E, out, in/32]``
E8M0 exponents, bias 127) with ``quantization_config.quant_method = "mxfp4"``; the converter then
writes them to the GGUF as MXFP4 without re-quantizing. The float weights are the same draws as
without it, so the F32 checkpoint of the same seed is the MXFP4 one's original.
`convert` then runs llama.cpp's converter on it (in its own virtual environment, with torch),
so the GGUF tensor names, splits (``attn_k_b``/``attn_v_b``), merged expert tensors and metadata
are llama.cpp's, not EStream's.

The converter recognises a tokenizer by hashing how it encodes a fixed text; a synthetic
vocabulary matches no published one, so the driver names the pre-tokenizer ``default`` instead
of stopping there (the only step it changes; the weights and hyper-parameters go through the
converter untouched).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CONVERT_DIR = ROOT / ".cache" / "llama-convert"
SDIST = "llama-cpp-python==0.3.36"
# torch for the converter: the CPU build when the package index offers it (≈ 190 MB), else torch
TORCH = os.environ.get("ESTREAM_CONVERT_TORCH", "torch==2.13.0+cpu")
CONVERT_DEPS = ("transformers", "safetensors", "sentencepiece", "protobuf", "numpy")

HF_ARCH = {
    "deepseek2": "DeepseekV2ForCausalLM",
    "lfm2moe": "Lfm2MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "smallthinker": "SmallThinkerForCausalLM",
}
#: FP4 E2M1, the values of MXFP4's 4-bit codes (before the block's power-of-two scale)
FP4_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
#: gpt-oss's SwiGLU clamp (config.json ``swiglu_limit``; llama.cpp's graph fixes it at 7)
GPT_OSS_SWIGLU_LIMIT = 7.0


class ConverterError(RuntimeError):
    """llama.cpp's converter could not be installed or refused the checkpoint."""


# ------------------------------------------------------------------------------ safetensors
def _st_array(a: np.ndarray) -> np.ndarray:
    """`a` as stored: uint8 as bytes (MXFP4 blocks and scales), anything else as F32."""
    if a.dtype == np.uint8:
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(a, dtype="<f4")


def save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: u64 header length, JSON header, raw little-endian data (F32, or
    U8 for uint8 arrays)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, a in tensors.items():
        n = _st_array(a).nbytes
        header[name] = {
            "dtype": "U8" if a.dtype == np.uint8 else "F32",
            "shape": list(a.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".part")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in tensors.values():
            f.write(_st_array(a).tobytes())
    tmp.replace(path)


def mxfp4_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`w` (``[..., cols]``, cols a multiple of 32) as Hugging Face's MXFP4 tensors:
    ``blocks`` ``[..., cols/32, 16]`` uint8 (two E2M1 codes a byte, element ``2j`` in the low
    nibble, ``2j+1`` in the high one) and ``scales`` ``[..., cols/32]`` uint8 (E8M0: the block's
    power-of-two exponent + 127, the smallest that keeps its largest magnitude within 6).
    Each value is rounded to the nearest code (ties to the lower code)."""
    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 rows must be a multiple of 32 long, not {w.shape[-1]}")
    b = np.asarray(w, dtype=np.float32).reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(b).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, np.float32(2.0**-120)) / 6.0))
    exp = np.clip(exp, -127, 127)
    scaled = b / np.exp2(exp)[..., None]
    codes = np.empty(b.shape, dtype=np.uint8)
    for idx in np.ndindex(b.shape[:-2]):  # one row at a time: bounded memory
        dist = np.abs(scaled[idx][..., None] - FP4_E2M1)
        codes[idx] = dist.argmin(axis=-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def mxfp4_unpack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float values of Hugging Face MXFP4 `blocks` and `scales` (`mxfp4_pack`'s layout):
    ``[..., cols]``."""
    lo, hi = FP4_E2M1[blocks & 0x0F], FP4_E2M1[blocks >> 4]
    vals = np.stack((lo, hi), axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * np.exp2(scales.astype(np.float32) - 127.0)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


# ------------------------------------------------------------------------------ checkpoint
def _tokenizer(out: Path, n_vocab: int, seed: int) -> tuple[int, int]:
    """A byte-level BPE tokenizer.json of `n_vocab` tokens; returns (bos, eos) ids."""
    from estream_layout.synth import generate_bpe_vocab

    v = generate_bpe_vocab(n_vocab, seed=seed)
    tokens: list[str] = v["tokenizer.ggml.tokens"]
    eos = int(v["tokenizer.ggml.eos_token_id"])
    specials = {i for i, t in enumerate(v["tokenizer.ggml.token_type"]) if t == 3}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in sorted(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens) if i not in specials},
            "merges": list(v["tokenizer.ggml.merges"]),
        },
    }
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokens[eos],
                "eos_token": tokens[eos],
                "model_max_length": 1 << 20,
            }
        )
    )
    return eos, eos


def write_checkpoint(
    arch: str, dims: Any, out: Path, *, seed: int = 0, mxfp4: bool = False
) -> Path:
    """A synthetic HF checkpoint of `arch` with estream-synth's `SynthDims` `dims` in `out`;
    ``mxfp4``: the experts in MXFP4 as the published gpt-oss checkpoints (gpt-oss only)."""
    if arch not in HF_ARCH:
        raise ValueError(f"no Hugging Face layout for {arch!r}; choose from {sorted(HF_ARCH)}")
    if mxfp4 and arch != "gpt-oss":
        raise ValueError(f"no MXFP4 checkpoint layout for {arch!r}; only gpt-oss has one")
    d = dims
    out.mkdir(parents=True, exist_ok=True)
    bos, eos = _tokenizer(out, d.n_vocab, seed)
    rng = np.random.default_rng([seed, 11])
    ne, E = d.n_embd, d.n_experts
    t: dict[str, np.ndarray] = {}

    def lin(name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        t[name] = rng.standard_normal((rows, cols), dtype=np.float32) * (gain / np.sqrt(cols))

    def norm(name: str, n: int) -> None:
        t[name] = 1.0 + 0.02 * rng.standard_normal(n, dtype=np.float32)

    u = rng.standard_normal(ne, dtype=np.float32)
    t["model.embed_tokens.weight"] = 0.5 * (
        rng.standard_normal((d.n_vocab, ne), dtype=np.float32) + 0.5 * u
    )
    if arch == "deepseek2":
        k_mla = d.qk_nope_dim + d.qk_rope_dim
        for i in range(d.n_layers):
            p = f"model.layers.{i}."
            norm(p + "input_layernorm.weight", ne)
            norm(p + "post_attention_layernorm.weight", ne)
            if d.q_lora_rank > 0:
                lin(p + "self_attn.q_a_proj.weight", d.q_lora_rank, ne)
                norm(p + "self_attn.q_a_layernorm.weight", d.q_lora_rank)
                lin(p + "self_attn.q_b_proj.weight", d.n_head * k_mla, d.q_lora_rank)
            else:
                lin(p + "self_attn.q_proj.weight", d.n_head * k_mla, ne)
            lin(p + "self_attn.kv_a_proj_with_mqa.weight", d.kv_lora_rank + d.qk_rope_dim, ne)
            norm(p + "self_attn.kv_a_layernorm.weight", d.kv_lora_rank)
            lin(p + "self_attn.kv_b_proj.weight",
                d.n_head * (d.qk_nope_dim + d.v_head_dim), d.kv_lora_rank)  # fmt: skip
            lin(p + "self_attn.o_proj.weight", ne, d.n_head * d.v_head_dim, 0.5)
            if i < d.n_leading_dense:
                lin(p + "mlp.gate_proj.weight", d.n_ff, ne)
                lin(p + "mlp.up_proj.weight", d.n_ff, ne)
                lin(p + "mlp.down_proj.weight", ne, d.n_ff, 0.5)
                continue
            t[p + "mlp.gate.weight"] = rng.standard_normal((E, ne), dtype=np.float32) * (
                2.0 / np.sqrt(ne)
            )
            for e in range(E):
                lin(p + f"mlp.experts.{e}.gate_proj.weight", d.n_ff_exp, ne)
                lin(p + f"mlp.experts.{e}.up_proj.weight", d.n_ff_exp, ne)
                lin(p + f"mlp.experts.{e}.down_proj.weight", ne, d.n_ff_exp, 0.5)
            w = d.n_ff_exp * d.n_shared_experts
            lin(p + "mlp.shared_experts.gate_proj.weight", w, ne)
            lin(p + "mlp.shared_experts.up_proj.weight", w, ne)
            lin(p + "mlp.shared_experts.down_proj.weight", ne, w, 0.5)
        norm("model.norm.weight", ne)
        lin("lm_head.weight", d.n_vocab, ne)
        config: dict[str, Any] = {
            "architectures": [HF_ARCH[arch]],
            "model_type": "deepseek_v2",
            "vocab_size": d.n_vocab,
            "hidden_size": ne,
            "intermediate_size": d.n_ff,
            "moe_intermediate_size": d.n_ff_exp,
            "num_hidden_layers": d.n_layers,
            "num_attention_heads": d.n_head,
            "num_key_value_heads": d.n_head,
            "n_shared_experts": d.n_shared_experts,
            "n_routed_experts": E,
            "num_experts_per_tok": d.n_experts_used,
            "first_k_dense_replace": d.n_leading_dense,
            "moe_layer_freq": 1,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "scoring_func": "softmax",
            "norm_topk_prob": False,
            "q_lora_rank": d.q_lora_rank or None,
            "kv_lora_rank": d.kv_lora_rank,
            "qk_nope_head_dim": d.qk_nope_dim,
            "qk_rope_head_dim": d.qk_rope_dim,
            "v_head_dim": d.v_head_dim,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": d.n_ctx,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        if d.yarn_factor > 0:  # DeepSeek-V2-Lite's rope_scaling block
            config["rope_scaling"] = {
                "type": "yarn",
                "factor": d.yarn_factor,
                "original_max_position_embeddings": d.yarn_orig_ctx,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": round(d.yarn_log_mul * 10, 6),
                "mscale_all_dim": round(d.yarn_log_mul * 10, 6),
            }
    elif arch == "gpt-oss":
        config = _gpt_oss(d, t, rng, lin, norm, mxfp4)
    elif arch == "smallthinker":
        config = _smallthinker(d, t, rng, lin, norm)
    else:  # lfm2moe
        hd = d.head_dim
        layer_types = [
            "full_attention" if d.lfm2_is_attention(i) else "conv" for i in range(d.n_layers)
        ]
        for i in range(d.n_layers):
            p = f"model.layers.{i}."
            norm(p + "operator_norm.weight", ne)
            norm(p + "ffn_norm.weight", ne)
            if layer_types[i] == "full_attention":
                lin(p + "self_attn.q_proj.weight", d.n_head * hd, ne)
                lin(p + "self_attn.k_proj.weight", d.n_head_kv * hd, ne)
                lin(p + "self_attn.v_proj.weight", d.n_head_kv * hd, ne)
                lin(p + "self_attn.out_proj.weight", ne, d.n_head * hd, 0.5)
                norm(p + "self_attn.q_layernorm.weight", hd)
                norm(p + "self_attn.k_layernorm.weight", hd)
            else:
                t[p + "conv.conv.weight"] = rng.standard_normal(
                    (ne, 1, d.l_cache), dtype=np.float32
                ) / np.sqrt(d.l_cache)
                lin(p + "conv.in_proj.weight", 3 * ne, ne)
                lin(p + "conv.out_proj.weight", ne, ne, 0.5)
            if i < d.n_leading_dense:
                lin(p + "feed_forward.w1.weight", d.n_ff, ne)
                lin(p + "feed_forward.w3.weight", d.n_ff, ne)
                lin(p + "feed_forward.w2.weight", ne, d.n_ff, 0.5)
                continue
            t[p + "feed_forward.gate.weight"] = rng.standard_normal((E, ne), dtype=np.float32) * (
                2.0 / np.sqrt(ne)
            )
            t[p + "feed_forward.expert_bias"] = 0.1 * rng.standard_normal(E, dtype=np.float32)
            for e in range(E):
                lin(p + f"feed_forward.experts.{e}.w1.weight", d.n_ff_exp, ne)
                lin(p + f"feed_forward.experts.{e}.w3.weight", d.n_ff_exp, ne)
                lin(p + f"feed_forward.experts.{e}.w2.weight", ne, d.n_ff_exp, 0.5)
        norm("model.embedding_norm.weight", ne)
        config = {
            "architectures": [HF_ARCH[arch]],
            "model_type": "lfm2_moe",
            "vocab_size": d.n_vocab,
            "hidden_size": ne,
            "intermediate_size": d.n_ff,
            "moe_intermediate_size": d.n_ff_exp,
            "num_hidden_layers": d.n_layers,
            "num_attention_heads": d.n_head,
            "num_key_value_heads": d.n_head_kv,
            "layer_types": layer_types,
            "conv_L_cache": d.l_cache,
            "conv_bias": False,
            "norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "max_position_embeddings": d.n_ctx,
            "num_experts": E,
            "num_experts_per_tok": d.n_experts_used,
            "num_dense_layers": d.n_leading_dense,
            "use_expert_bias": True,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "tie_embedding": True,
            "tie_word_embeddings": True,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
    config.update(bos_token_id=bos, eos_token_id=eos)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_safetensors(out / "model.safetensors", t)
    return out


def _gpt_oss(
    d: Any, t: dict[str, np.ndarray], rng: np.random.Generator, lin: Any, norm: Any, mxfp4: bool
) -> dict[str, Any]:
    """gpt-oss tensors into `t` (openai/gpt-oss-20b's names); returns its config.json."""
    ne, E, hd, ff = d.n_embd, d.n_experts, d.head_dim, d.n_ff_exp

    def bias(name: str, *shape: int) -> None:
        t[name] = 0.1 * rng.standard_normal(shape, dtype=np.float32)

    for i in range(d.n_layers):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", ne)
        for proj, rows in (("q", d.n_head * hd), ("k", d.n_head_kv * hd), ("v", d.n_head_kv * hd)):
            lin(p + f"self_attn.{proj}_proj.weight", rows, ne)
            bias(p + f"self_attn.{proj}_proj.bias", rows)
        lin(p + "self_attn.o_proj.weight", ne, d.n_head * hd, 0.5)
        bias(p + "self_attn.o_proj.bias", ne)
        t[p + "self_attn.sinks"] = rng.standard_normal(d.n_head, dtype=np.float32)
        norm(p + "post_attention_layernorm.weight", ne)
        t[p + "mlp.router.weight"] = rng.standard_normal((E, ne), dtype=np.float32) * (
            2.0 / np.sqrt(ne)
        )
        bias(p + "mlp.router.bias", E)
        # [E, out, in]; gate rows at even, up rows at odd positions of gate_up (as published)
        gate_up = rng.standard_normal((E, 2 * ff, ne), dtype=np.float32) * (1.0 / np.sqrt(ne))
        down = rng.standard_normal((E, ne, ff), dtype=np.float32) * (0.5 / np.sqrt(ff))
        for name, w in (("down_proj", down), ("gate_up_proj", gate_up)):
            if mxfp4:
                blocks, scales = mxfp4_pack(w)
                t[p + f"mlp.experts.{name}_blocks"] = blocks
                t[p + f"mlp.experts.{name}_scales"] = scales
            else:  # the dequantized (bf16) release stores them as [E, in, out]
                t[p + f"mlp.experts.{name}"] = np.ascontiguousarray(w.transpose(0, 2, 1))
        bias(p + "mlp.experts.down_proj_bias", E, ne)
        bias(p + "mlp.experts.gate_up_proj_bias", E, 2 * ff)
    norm("model.norm.weight", ne)
    lin("lm_head.weight", d.n_vocab, ne)
    window = d.sliding_window or 128
    config: dict[str, Any] = {
        "architectures": [HF_ARCH["gpt-oss"]],
        "model_type": "gpt_oss",
        "vocab_size": d.n_vocab,
        "hidden_size": ne,
        "intermediate_size": ff,
        "num_hidden_layers": d.n_layers,
        "num_attention_heads": d.n_head,
        "num_key_value_heads": d.n_head_kv,
        "head_dim": hd,
        "num_local_experts": E,
        "num_experts_per_tok": d.n_experts_used,
        "experts_per_token": d.n_experts_used,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "swiglu_limit": GPT_OSS_SWIGLU_LIMIT,
        "sliding_window": window,
        # the even layers slide (llama.cpp's fixed pattern for gpt-oss, as published)
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.n_layers)
        ],
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "max_position_embeddings": d.n_ctx,
        "initial_context_length": d.yarn_orig_ctx if d.yarn_factor > 0 else d.n_ctx,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if d.yarn_factor > 0:  # gpt-oss-20b's rope_scaling block
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": d.yarn_factor,
            "original_max_position_embeddings": d.yarn_orig_ctx,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    if mxfp4:  # as published: attention, router, embeddings and head stay unquantized
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    return config


#: SmallThinker's published layer layout: every 4th layer from 0 is full attention without
#: RoPE, the others slide with RoPE (PowerInfer/SmallThinker-4BA0.6B's config.json)
SMALLTHINKER_WINDOW = 4096


def _smallthinker(
    d: Any, t: dict[str, np.ndarray], rng: np.random.Generator, lin: Any, norm: Any
) -> dict[str, Any]:
    """SmallThinker tensors into `t` (PowerInfer's names); returns its config.json.

    With ``dims.sliding_window`` > 0 the layers follow the published layout (a window on
    three layers of four, NoPE on the fourth, from layer 0); with 0, no window and RoPE on every
    layer."""
    ne, E, hd, ff = d.n_embd, d.n_experts, d.head_dim, d.n_ff_exp
    for i in range(d.n_layers):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", ne)
        lin(p + "self_attn.q_proj.weight", d.n_head * hd, ne)
        lin(p + "self_attn.k_proj.weight", d.n_head_kv * hd, ne)
        lin(p + "self_attn.v_proj.weight", d.n_head_kv * hd, ne)
        lin(p + "self_attn.o_proj.weight", ne, d.n_head * hd, 0.5)
        norm(p + "post_attention_layernorm.weight", ne)
        t[p + "block_sparse_moe.primary_router.weight"] = rng.standard_normal(
            (E, ne), dtype=np.float32
        ) * (2.0 / np.sqrt(ne))
        for e in range(E):
            lin(p + f"block_sparse_moe.experts.{e}.gate.weight", ff, ne)
            lin(p + f"block_sparse_moe.experts.{e}.up.weight", ff, ne)
            lin(p + f"block_sparse_moe.experts.{e}.down.weight", ne, ff, 0.5)
    norm("model.norm.weight", ne)
    lin("lm_head.weight", d.n_vocab, ne)
    windowed = d.sliding_window > 0
    return {
        "architectures": [HF_ARCH["smallthinker"]],
        "model_type": "smallthinker",
        "vocab_size": d.n_vocab,
        "hidden_size": ne,
        "num_hidden_layers": d.n_layers,
        "num_attention_heads": d.n_head,
        "num_key_value_heads": d.n_head_kv,
        "head_dim": hd,
        "moe_num_primary_experts": E,
        "moe_num_active_primary_experts": d.n_experts_used,
        "moe_ffn_hidden_size": ff,
        "moe_primary_router_apply_softmax": d.expert_gating == "softmax",
        "moe_layer_layout": [1] * d.n_layers,
        "sliding_window_layout": [int(windowed and i % 4 != 0) for i in range(d.n_layers)],
        "sliding_window_size": SMALLTHINKER_WINDOW if windowed else None,
        "rope_layout": [int(not windowed or i % 4 != 0) for i in range(d.n_layers)],
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": d.n_ctx,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


# ------------------------------------------------------------------------------ converter
# Runs in the converter's environment: llama.cpp's convert_hf_to_gguf.py, with the tokenizer
# recognition answering "default" for a vocabulary it has no hash for.
_DRIVER = r"""
import sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
sys.path.insert(0, __import__("os").path.dirname(sys.argv[0]))
import conversion.base as base
_pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        print("synthetic tokenizer: pre-tokenizer 'default'", file=sys.stderr)
        return "default"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _venv_python() -> Path:
    return CONVERT_DIR / "venv" / "bin" / "python"


def ensure_converter(log: Any = print) -> tuple[Path, Path]:
    """(python, convert_hf_to_gguf.py) of llama.cpp's converter, installed once into
    ``.cache/llama-convert``: the script, its ``conversion`` package and ``gguf-py`` from the
    llama-cpp-python sdist (the same llama.cpp as the wheel), torch and transformers."""
    src = CONVERT_DIR / "llama.cpp"
    script = src / "convert_hf_to_gguf.py"
    if not script.exists():
        wheels = ROOT / ".cache" / "wheels"
        sdists = sorted(wheels.glob("llama_cpp_python-0.3.36.tar.gz"))
        if not sdists:
            log(f"downloading the {SDIST} sdist (llama.cpp's converter) …")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                 ":all:", SDIST, "-d", str(wheels)],
                check=True,
            )  # fmt: skip
            sdists = sorted(wheels.glob("llama_cpp_python-0.3.36.tar.gz"))
        want = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        tmp = CONVERT_DIR / "llama.cpp.part"
        with tarfile.open(sdists[-1]) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 3)  # <top>/vendor/llama.cpp/<rest>
                inside = len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"]
                if inside and any(parts[3] == w or parts[3].startswith(w) for w in want):
                    m.name = parts[3]
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        tmp.replace(src)
    py = _venv_python()
    if not py.exists() or subprocess.run([py, "-c", "import torch, transformers, gguf"],
                                         capture_output=True).returncode:  # fmt: skip
        log("installing the converter's environment (torch, transformers) …")
        subprocess.run([sys.executable, "-m", "venv", str(CONVERT_DIR / "venv")], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        if subprocess.run([*pip, TORCH]).returncode:
            subprocess.run([*pip, "torch"], check=True)
        subprocess.run([*pip, *CONVERT_DEPS], check=True)
        subprocess.run([*pip, "-e", str(src / "gguf-py")], check=True)
    return py, script


def convert(hf_dir: Path, out: Path, outtype: str = "f32", timeout: float = 1800.0) -> str:
    """Run llama.cpp's converter on `hf_dir`, writing `out` (temporary name, then renamed);
    returns its log, raises `ConverterError` with the log's tail if it fails."""
    py, script = ensure_converter()
    tmp = out.with_name(out.name + ".part")
    try:
        done = subprocess.run(
            [str(py), "-c", _DRIVER, str(script), str(hf_dir), "--outfile", str(tmp),
             "--outtype", outtype],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        log = done.stderr + done.stdout
        if done.returncode != 0 or not tmp.exists():
            raise ConverterError("\n".join(log.strip().splitlines()[-15:]))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return log
