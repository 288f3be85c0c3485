"""Synthetic Hugging Face checkpoints for llama.cpp's own converter (``convert_hf_to_gguf.py``).

`write_checkpoint` writes a directory as the DeepSeek-V2 (``DeepseekV2ForCausalLM``) and
LFM2-MoE (``Lfm2MoeForCausalLM``) releases lay it out — ``config.json`` with the published
field names, ``model.safetensors`` with the Hugging Face tensor names and shapes (one tensor per
expert, ``kv_b_proj`` fused, the depthwise ``conv.conv`` kernel as ``[d, 1, L]``), a byte-level
BPE ``tokenizer.json`` — filled with Gaussian F32 weights at the scales estream-synth uses.
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

HF_ARCH = {"deepseek2": "DeepseekV2ForCausalLM", "lfm2moe": "Lfm2MoeForCausalLM"}


class ConverterError(RuntimeError):
    """llama.cpp's converter could not be installed or refused the checkpoint."""


# ------------------------------------------------------------------------------ safetensors
def save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: u64 header length, JSON header, raw little-endian data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, a in tensors.items():
        n = a.astype("<f4").nbytes
        header[name] = {
            "dtype": "F32",
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
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())
    tmp.replace(path)


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


def write_checkpoint(arch: str, dims: Any, out: Path, *, seed: int = 0) -> Path:
    """A synthetic HF checkpoint of `arch` with estream-synth's `SynthDims` `dims` in `out`."""
    if arch not in HF_ARCH:
        raise ValueError(f"no Hugging Face layout for {arch!r}; choose from {sorted(HF_ARCH)}")
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
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_safetensors(out / "model.safetensors", t)
    return out


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
