"""Shared configuration and fixtures of the cross-package tests.

Hypothesis profiles: ``ci`` (the default, selected by ``HYPOTHESIS_PROFILE=ci`` in nox) and
``dev`` (more examples). Fixtures are grouped by topic below; keep each group self-contained.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ------------------------------------------------------------------------------------------
# Tiny hand-written GGUF MoE models (independent of estream_layout.synth), for the reference's
# self-checks. Tensor names and metadata keys follow llama.cpp (src/llama-arch.cpp).
# ------------------------------------------------------------------------------------------

TINY_ARCHS = ("olmoe", "qwen3moe", "llama", "deepseek2", "lfm2moe", "smallthinker")


class TinyModel:
    """Metadata plus float32 tensors (numpy order) of a tiny MoE model; ``write`` makes a GGUF.

    Tensors are kept as float32 so that tests can edit them (e.g. permute experts) before
    writing. ``qtype`` quantizes every 2-D/3-D matrix whose rows are a multiple of 32 wide.
    """

    def __init__(self, arch: str, metadata: dict[str, object], tensors: dict[str, np.ndarray]):
        self.arch = arch
        self.metadata = metadata
        self.tensors = tensors

    @property
    def n_vocab(self) -> int:
        return int(self.tensors["token_embd.weight"].shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.metadata[f"{self.arch}.block_count"])  # type: ignore[call-overload]

    def copy(self) -> TinyModel:
        return TinyModel(
            self.arch, dict(self.metadata), {k: v.copy() for k, v in self.tensors.items()}
        )

    def write(self, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
        writer = GGUFWriter(str(path), self.arch)
        for key, value in self.metadata.items():
            if isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)
            elif isinstance(value, float):
                writer.add_float32(key, value)
            elif isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, list):
                writer.add_array(key, value)
            else:
                raise TypeError(f"metadata {key}: {type(value)}")
        n_vocab = self.n_vocab
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>", *[f"t{i}" for i in range(3, n_vocab)]])
        writer.add_token_scores([0.0] * n_vocab)
        writer.add_token_types([2, 3, 3, *([1] * (n_vocab - 3))])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        for name, array in self.tensors.items():
            array = np.ascontiguousarray(array, dtype=np.float32)
            if qtype != GGMLQuantizationType.F32 and array.ndim >= 2 and array.shape[-1] % 32 == 0:
                writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def make_tiny_model(
    arch: str,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_embd: int = 64,
    n_ff_exp: int = 32,
    n_vocab: int = 96,
    mla_split: bool = True,
) -> TinyModel:
    """A random tiny model of ``arch`` with llama.cpp's tensor names and metadata keys."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}")
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, *, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    n_head, n_head_kv, head_dim = 4, 2, 16
    a = arch
    md: dict[str, object] = {
        f"{a}.context_length": 4096,
        f"{a}.embedding_length": n_embd,
        f"{a}.block_count": n_layer,
        f"{a}.feed_forward_length": n_ff_exp if arch in ("olmoe", "llama") else 2 * n_ff_exp,
        f"{a}.attention.head_count": n_head,
        f"{a}.attention.head_count_kv": n_head_kv,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.expert_count": n_expert,
        f"{a}.expert_used_count": n_expert_used,
    }
    t: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, n_embd)).astype(np.float32),
        "output_norm.weight": norm(n_embd),
        "output.weight": mat(n_vocab, n_embd),
    }

    def experts(p: str) -> None:
        t[p + "ffn_gate_inp.weight"] = mat(n_expert, n_embd, gain=3.0)
        t[p + "ffn_gate_exps.weight"] = np.stack([mat(n_ff_exp, n_embd) for _ in range(n_expert)])
        t[p + "ffn_up_exps.weight"] = np.stack([mat(n_ff_exp, n_embd) for _ in range(n_expert)])
        t[p + "ffn_down_exps.weight"] = np.stack([mat(n_embd, n_ff_exp) for _ in range(n_expert)])

    def dense_ffn(p: str, ff: int) -> None:
        t[p + "ffn_gate.weight"] = mat(ff, n_embd)
        t[p + "ffn_up.weight"] = mat(ff, n_embd)
        t[p + "ffn_down.weight"] = mat(n_embd, ff)

    def gqa_attention(p: str, q_norm: int | None) -> None:
        t[p + "attn_q.weight"] = mat(n_head * head_dim, n_embd)
        t[p + "attn_k.weight"] = mat(n_head_kv * head_dim, n_embd)
        t[p + "attn_v.weight"] = mat(n_head_kv * head_dim, n_embd)
        t[p + "attn_output.weight"] = mat(n_embd, n_head * head_dim)
        if q_norm is not None:
            t[p + "attn_q_norm.weight"] = norm(q_norm)
            t[p + "attn_k_norm.weight"] = norm(q_norm if arch != "olmoe" else n_head_kv * head_dim)

    if arch == "olmoe":
        # llama.cpp requires n_embd_gqa == n_embd for OLMoE's k-norm shape: use MHA.
        n_head_kv = n_head
        md[f"{a}.attention.head_count_kv"] = n_head
    for il in range(n_layer):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = norm(n_embd)
        t[p + "ffn_norm.weight"] = norm(n_embd)
        if arch == "olmoe":
            gqa_attention(p, n_head * head_dim)
            experts(p)
        elif arch == "qwen3moe":
            gqa_attention(p, head_dim)
            experts(p)
        elif arch in ("llama", "smallthinker"):
            gqa_attention(p, None)
            experts(p)
        elif arch == "deepseek2":
            _deepseek2_layer(t, p, mat, norm, n_embd, n_head, mla_split)
            if il == 0:
                dense_ffn(p, 2 * n_ff_exp)
            else:
                experts(p)
                t[p + "ffn_gate_shexp.weight"] = mat(n_ff_exp, n_embd)
                t[p + "ffn_up_shexp.weight"] = mat(n_ff_exp, n_embd)
                t[p + "ffn_down_shexp.weight"] = mat(n_embd, n_ff_exp)
        elif arch == "lfm2moe":
            if il % 2 == 0:  # short-convolution layer
                t[p + "shortconv.in_proj.weight"] = mat(3 * n_embd, n_embd)
                t[p + "shortconv.conv.weight"] = (0.5 * rng.standard_normal((n_embd, 3))).astype(
                    np.float32
                )
                t[p + "shortconv.out_proj.weight"] = mat(n_embd, n_embd)
            else:
                gqa_attention(p, head_dim)
            if il == 0:
                dense_ffn(p, 2 * n_ff_exp)
            else:
                experts(p)
                t[p + "exp_probs_b.bias"] = (0.1 * rng.standard_normal(n_expert)).astype(np.float32)
    if arch == "qwen3moe":
        md[f"{a}.attention.key_length"] = head_dim
        md[f"{a}.attention.value_length"] = head_dim
        md[f"{a}.expert_feed_forward_length"] = n_ff_exp
    elif arch == "llama":
        md[f"{a}.rope.dimension_count"] = head_dim
        md[f"{a}.vocab_size"] = n_vocab
        del t["output.weight"]  # tied head: exercises the token_embd fallback
    elif arch == "deepseek2":
        rank, d_nope, d_rope, dv = _MLA
        md[f"{a}.leading_dense_block_count"] = 1
        md[f"{a}.expert_feed_forward_length"] = n_ff_exp
        md[f"{a}.expert_shared_count"] = 1
        md[f"{a}.expert_weights_scale"] = 1.5
        md[f"{a}.expert_weights_norm"] = True
        md[f"{a}.expert_gating_func"] = 2  # sigmoid
        md[f"{a}.attention.q_lora_rank"] = 0
        md[f"{a}.attention.kv_lora_rank"] = rank
        md[f"{a}.rope.dimension_count"] = d_rope
        md[f"{a}.attention.head_count_kv"] = 1 if mla_split else n_head
        if mla_split:
            md[f"{a}.attention.key_length"] = rank + d_rope
            md[f"{a}.attention.value_length"] = rank
            md[f"{a}.attention.key_length_mla"] = d_nope + d_rope
            md[f"{a}.attention.value_length_mla"] = dv
        else:
            md[f"{a}.attention.key_length"] = d_nope + d_rope
            md[f"{a}.attention.value_length"] = dv
        for il in range(1, n_layer):
            t[f"blk.{il}.exp_probs_b.bias"] = (0.1 * rng.standard_normal(n_expert)).astype(
                np.float32
            )
    elif arch == "smallthinker":
        md[f"{a}.expert_feed_forward_length"] = n_ff_exp
        md[f"{a}.expert_gating_func"] = 2  # sigmoid (moe_primary_router_apply_softmax false)
        md[f"{a}.attention.sliding_window"] = 4096  # layer 0 NoPE, the others slide
    elif arch == "lfm2moe":
        md[f"{a}.attention.head_count_kv"] = [
            0 if il % 2 == 0 else n_head_kv for il in range(n_layer)
        ]
        md[f"{a}.shortconv.l_cache"] = 3
        md[f"{a}.leading_dense_block_count"] = 1
        md[f"{a}.expert_feed_forward_length"] = n_ff_exp
        md[f"{a}.expert_gating_func"] = 2
        t["token_embd_norm.weight"] = t.pop("output_norm.weight")
        del t["output.weight"]
    return TinyModel(arch, md, t)


# DeepSeek-2 MLA sizes of the tiny model: kv_lora_rank, qk_nope, qk_rope, v head dim.
_MLA = (32, 16, 8, 16)


def _deepseek2_layer(
    t: dict[str, np.ndarray],
    p: str,
    mat: Callable[[int, int], np.ndarray],
    norm: Callable[[int], np.ndarray],
    n_embd: int,
    n_head: int,
    mla_split: bool,
) -> None:
    """MLA attention tensors of one DeepSeek-2 layer (q without low rank, as V2-Lite)."""
    rank, d_nope, d_rope, dv = _MLA
    t[p + "attn_q.weight"] = mat(n_head * (d_nope + d_rope), n_embd)
    t[p + "attn_kv_a_mqa.weight"] = mat(rank + d_rope, n_embd)
    t[p + "attn_kv_a_norm.weight"] = norm(rank)
    kv_b = mat(n_head * (d_nope + dv), rank)
    if mla_split:
        # As llama.cpp's converter splits kv_b: k_b[h] = W_k[h]ᵀ, v_b[h] = W_v[h].
        per_head = kv_b.reshape(n_head, d_nope + dv, rank)
        t[p + "attn_k_b.weight"] = np.ascontiguousarray(per_head[:, :d_nope, :].transpose(0, 2, 1))
        t[p + "attn_v_b.weight"] = np.ascontiguousarray(per_head[:, d_nope:, :])
    else:
        t[p + "attn_kv_b.weight"] = kv_b
    t[p + "attn_output.weight"] = mat(n_embd, n_head * dv)


def mla_split_pair(seed: int) -> tuple[TinyModel, TinyModel]:
    """The same DeepSeek-2 weights written with a fused ``attn_kv_b`` and with split k_b/v_b."""
    fused = make_tiny_model("deepseek2", seed=seed, mla_split=False)
    split = fused.copy()
    md = split.metadata
    rank, d_nope, d_rope, dv = _MLA
    md["deepseek2.attention.head_count_kv"] = 1
    md["deepseek2.attention.key_length"] = rank + d_rope
    md["deepseek2.attention.value_length"] = rank
    md["deepseek2.attention.key_length_mla"] = d_nope + d_rope
    md["deepseek2.attention.value_length_mla"] = dv
    n_head = int(md["deepseek2.attention.head_count"])  # type: ignore[call-overload]
    for il in range(split.n_layer):
        p = f"blk.{il}."
        per_head = split.tensors.pop(p + "attn_kv_b.weight").reshape(n_head, d_nope + dv, rank)
        split.tensors[p + "attn_k_b.weight"] = np.ascontiguousarray(
            per_head[:, :d_nope, :].transpose(0, 2, 1)
        )
        split.tensors[p + "attn_v_b.weight"] = np.ascontiguousarray(per_head[:, d_nope:, :])
    return fused, split


@pytest.fixture(scope="session")
def tiny_gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., TinyModel]:
    """Factory: ``tiny_model(arch, seed=..., ...)`` → an editable :class:`TinyModel`."""
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_gguf(tiny_gguf_dir: Path) -> Callable[..., Path]:
    """Factory: ``tiny_gguf(arch, qtype=F32, **kw)`` → path of a written tiny GGUF (memoised)."""
    cache: dict[tuple[object, ...], Path] = {}

    def build(
        arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32, **kw: object
    ) -> Path:
        key = (arch, qtype, tuple(sorted(kw.items())))
        if key not in cache:
            path = tiny_gguf_dir / f"{arch}-{qtype.name}-{len(cache)}.gguf"
            cache[key] = make_tiny_model(arch, **kw).write(path, qtype)  # type: ignore[arg-type]
        return cache[key]

    return build


@pytest.fixture(scope="session")
def mla_pair() -> Callable[[int], tuple[TinyModel, TinyModel]]:
    return mla_split_pair
