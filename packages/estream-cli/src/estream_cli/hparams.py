"""Model hyper-parameters as the engine needs them, read from a packed model's `model.gguf`.

The engine only ever sees the packed model; `model.gguf` carries the source model's metadata
(and tokenizer) with no tensors. Conventions follow llama.cpp per architecture: RoPE style,
q/k-norm placement and router normalisation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from .errors import PackError, UnsupportedModelError

__all__ = ["HParams", "read_gguf_kv"]

# Architectures the engine has graphs for, and how llama.cpp treats them.
#   rope:  "normal" = adjacent pairs (LLAMA_ROPE_TYPE_NORM), "neox" = split halves.
#   qk_norm: None | "full" (RMSNorm over the whole projected q/k, OLMoE) | "head" (per head, Qwen3)
#   norm_topk: renormalise the selected router weights (llama.cpp's expert_weights_norm)
_ARCHS: dict[str, dict[str, Any]] = {
    "olmoe": {"rope": "neox", "qk_norm": "full", "norm_topk": False},
    "qwen3moe": {"rope": "neox", "qk_norm": "head", "norm_topk": True},
    "mixtral": {"rope": "normal", "qk_norm": None, "norm_topk": True},
}


def read_gguf_kv(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (header only: fast)."""
    from estream_layout.gguf_header import read_header

    try:
        return dict(read_header(path).kv)
    except FileNotFoundError:
        raise PackError(f"{path}: no such file") from None
    except Exception as exc:  # truncated / corrupt header
        raise PackError(f"{path}: not a readable GGUF file ({exc})") from exc


@attrs.frozen
class HParams:
    arch: str  # engine graph family: olmoe | qwen3moe | mixtral
    gguf_arch: str  # general.architecture as written in the file
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int
    n_ctx: int
    n_experts: int
    n_experts_used: int
    n_ff_exp: int
    rms_eps: float
    rope_base: float
    rope_scale: float
    rope: str
    qk_norm: str | None
    norm_topk: bool
    expert_weights_scale: float

    @classmethod
    def from_kv(cls, kv: dict[str, Any]) -> HParams:
        gguf_arch = str(kv.get("general.architecture", ""))
        if not gguf_arch:
            raise PackError("model.gguf has no general.architecture")
        a = gguf_arch

        def get(key: str, default: Any = None) -> Any:
            v = kv.get(f"{a}.{key}", default)
            if isinstance(v, list):  # per-layer arrays: the engine needs a uniform value
                v = v[0]
            return v

        n_experts = int(get("expert_count", 0) or 0)
        arch = "mixtral" if a == "llama" and n_experts > 0 else a
        if arch not in _ARCHS:
            known = ", ".join(sorted(_ARCHS))
            raise UnsupportedModelError(
                f"architecture {gguf_arch!r} has no engine graph yet (supported: {known})"
            )
        if n_experts == 0:
            raise UnsupportedModelError(f"{gguf_arch!r} model has no experts: nothing to stream")
        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        n_head_kv = int(get("attention.head_count_kv", n_head))
        head_dim = int(get("attention.key_length", n_embd // n_head))
        tokens = kv.get("tokenizer.ggml.tokens")
        n_vocab = int(get("vocab_size", len(tokens) if tokens is not None else 0))
        scale = get("rope.scaling.factor", None)
        rope_scale = (
            1.0 / float(scale)
            if scale
            and get("rope.scaling.type", "linear")
            in (
                "linear",
                None,
            )
            else 1.0
        )
        n_ff_exp = get("expert_feed_forward_length", None)
        if n_ff_exp is None:
            n_ff_exp = get("feed_forward_length")
        conf = _ARCHS[arch]
        norm_topk = bool(get("expert_weights_norm", conf["norm_topk"]))
        return cls(
            arch=arch,
            gguf_arch=gguf_arch,
            n_layers=int(get("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_rot=int(get("rope.dimension_count", head_dim)),
            n_vocab=n_vocab,
            n_ctx=int(get("context_length", 4096)),
            n_experts=n_experts,
            n_experts_used=int(get("expert_used_count")),
            n_ff_exp=int(n_ff_exp),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rope_scale=rope_scale,
            rope=conf["rope"],
            qk_norm=conf["qk_norm"],
            norm_topk=norm_topk,
            expert_weights_scale=float(get("expert_weights_scale", 1.0) or 1.0),
        )

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)
