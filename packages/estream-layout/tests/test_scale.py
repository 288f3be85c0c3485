"""Large-model support: the published-shape presets, refusing early when the disk is too small,
and memory that does not grow with the model while synthesizing and packing."""

from __future__ import annotations

import math
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from estream_layout import (
    InsufficientDiskSpaceError,
    ModelSpec,
    pack_model,
    planned_pack_bytes,
    synth_dims,
    synth_model,
)
from estream_layout.cli import pack_main, synth_main
from estream_layout.synth import _tensor_plan

GiB = 1 << 30


def _expert_bytes(arch: str, preset: str) -> int:
    d = synth_dims(arch, preset)
    plan = _tensor_plan(arch, d, d.n_vocab, Q.Q4_0, Q.Q4_0, Q.Q8_0)
    return sum(t.nbytes for t in plan if "_exps." in t.name)


def test_qwen3_30b_a3b_shapes() -> None:
    d = synth_dims("qwen3moe", "qwen3-30b-a3b")
    assert (d.n_layers, d.n_embd, d.n_head, d.n_head_kv, d.head_dim) == (48, 2048, 32, 4, 128)
    assert (d.n_experts, d.n_experts_used, d.n_ff_exp, d.n_vocab) == (128, 8, 768, 151936)
    # 30.5 B parameters in all: 29.0 B in the experts, ~1.5 B in attention, embeddings, output
    n_exp = d.n_layers * d.n_experts * 3 * d.n_embd * d.n_ff_exp
    assert 28.9e9 < n_exp < 29.1e9
    # Q4_0 experts: 18 bytes per 32 weights
    assert _expert_bytes("qwen3moe", "qwen3-30b-a3b") == n_exp // 32 * 18


def test_mixtral_8x7b_shapes() -> None:
    d = synth_dims("mixtral", "mixtral-8x7b")
    assert (d.n_layers, d.n_embd, d.n_head, d.n_head_kv, d.head_dim) == (32, 4096, 32, 8, 128)
    assert (d.n_experts, d.n_experts_used, d.n_ff_exp, d.n_vocab) == (8, 2, 14336, 32000)
    n_exp = d.n_layers * d.n_experts * 3 * d.n_embd * d.n_ff_exp
    assert 45.0e9 < n_exp < 45.2e9  # of Mixtral-8x7B's 46.7 B parameters
    assert _expert_bytes("mixtral", "mixtral-8x7b") > 25 * 10**9  # ~26 GB GGUF: beyond RAM here


def test_deepseek_v2_lite_shapes() -> None:
    """deepseek-ai/DeepSeek-V2-Lite: 15.7 B parameters, 14.9 B of them in routed experts."""
    d = synth_dims("deepseek2", "deepseek-v2-lite")
    assert (d.n_layers, d.n_leading_dense, d.n_embd, d.n_head) == (27, 1, 2048, 16)
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_nope_dim, d.qk_rope_dim, d.v_head_dim) == (
        0, 512, 128, 64, 128,
    )  # fmt: skip
    assert (d.n_experts, d.n_experts_used, d.n_shared_experts) == (64, 6, 2)
    assert (d.n_ff_exp, d.n_ff, d.n_vocab) == (1408, 10944, 102400)
    assert (d.yarn_factor, d.yarn_orig_ctx, d.yarn_log_mul) == (40.0, 4096, 0.0707)
    n_exp = 26 * d.n_experts * 3 * d.n_embd * d.n_ff_exp
    assert 14.3e9 < n_exp < 14.5e9
    plan = {t.name: t for t in _tensor_plan("deepseek2", d, d.n_vocab, Q.Q4_0, Q.Q4_0, Q.Q8_0)}
    # llama.cpp's deepseek2 tensors and shapes (numpy order), no q LoRA
    assert plan["blk.1.attn_q.weight"].shape == (16 * 192, 2048)
    assert "blk.1.attn_q_a.weight" not in plan
    assert plan["blk.1.attn_kv_a_mqa.weight"].shape == (512 + 64, 2048)
    assert plan["blk.1.attn_kv_a_norm.weight"].shape == (512,)
    assert plan["blk.1.attn_k_b.weight"].shape == (16, 512, 128)
    assert plan["blk.1.attn_v_b.weight"].shape == (16, 128, 512)
    assert plan["blk.1.attn_output.weight"].shape == (2048, 16 * 128)
    assert plan["blk.0.ffn_gate.weight"].shape == (10944, 2048)
    assert plan["blk.1.ffn_gate_shexp.weight"].shape == (2 * 1408, 2048)
    assert plan["blk.1.ffn_gate_inp.weight"].shape == (64, 2048)
    assert "blk.0.ffn_gate_inp.weight" not in plan and "blk.26.ffn_down_exps.weight" in plan


def test_lfm2_8b_a1b_shapes() -> None:
    d = synth_dims("lfm2moe", "lfm2-8b-a1b")
    assert (d.n_layers, d.n_embd, d.n_head, d.n_head_kv, d.head_dim) == (24, 2048, 32, 8, 64)
    assert (d.n_experts, d.n_experts_used, d.n_ff_exp, d.n_ff) == (32, 4, 1792, 7168)
    assert (d.n_leading_dense, d.l_cache, d.n_vocab) == (2, 3, 65536)
    plan = _tensor_plan("lfm2moe", d, d.n_vocab, Q.Q4_0, Q.Q4_0, Q.Q8_0)
    # Liquid AI's figures: 8.3 B parameters in all, 1.5 B active per token (top-4 of 32).
    total = sum(math.prod(t.shape) for t in plan)
    experts = sum(math.prod(t.shape) for t in plan if "_exps." in t.name)
    active = total - experts + experts * d.n_experts_used // d.n_experts
    assert 8.2e9 < total < 8.45e9, total
    assert 1.45e9 < active < 1.6e9, active
    assert sum("shortconv.conv" in t.name for t in plan) == 18  # 18 convolution, 6 attention
    assert sum("attn_q.weight" in t.name for t in plan) == 6


def test_lfm2_8b_a1b_metadata_at_small_width(tmp_path: Path) -> None:
    """The preset's layer pattern and metadata, written narrow (the real widths are 4.7 GB)."""
    dims = {"n_embd": 64, "n_ff_exp": 32, "n_ff": 64, "head_dim": 2, "n_vocab": 400}
    s = ModelSpec.from_gguf(synth_model("lfm2moe", "lfm2-8b-a1b", tmp_path / "m.gguf", **dims))
    assert s.attention_layers == (2, 6, 10, 14, 18, 21)
    assert s.n_head_kv == tuple(8 if i in s.attention_layers else 0 for i in range(24))
    assert s.moe_layers == tuple(range(2, 24)) and s.n_leading_dense == 2
    assert (s.n_experts, s.n_experts_used, s.expert_gating_func) == (32, 4, "sigmoid")
    assert s.expert_weights_norm and s.shortconv_l_cache == 3
    assert (s.rope_freq_base, s.n_ctx) == (1e6, 128000) and s.rms_eps == pytest.approx(1e-5)
    assert "output.weight" not in s.tensors and "token_embd_norm.weight" in s.tensors


def test_model_presets_belong_to_one_arch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="use --arch mixtral"):
        synth_dims("olmoe", "mixtral-8x7b")
    assert synth_main(["--arch", "olmoe", "--preset", "qwen3-30b-a3b", "-o", "x.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "estream-synth: error: preset qwen3-30b-a3b is the shape of a qwen3moe model; "
        "use --arch qwen3moe"
    )


def _fake_free(monkeypatch: pytest.MonkeyPatch, free: int) -> list[str]:
    asked: list[str] = []
    real = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        asked.append(str(path))
        u = real(path)
        return type(u)(u.total, u.total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return asked


def test_synth_refuses_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked = _fake_free(monkeypatch, 10 * GiB)
    out = tmp_path / "sub" / "mixtral.gguf"
    with pytest.raises(InsufficientDiskSpaceError) as exc:
        synth_model("mixtral", "mixtral-8x7b", out)
    e = exc.value
    assert e.free == 10 * GiB and e.needed > 25 * 10**9
    assert "writing mixtral.gguf needs 24." in str(e) and "only 10.0 GiB free" in str(e)
    assert asked == [str(tmp_path)]  # the nearest existing directory was asked
    assert not out.parent.exists()  # nothing written, not even the directory
    assert synth_main(["--arch", "mixtral", "--preset", "mixtral-8x7b", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("estream-synth: error: writing mixtral.gguf needs ") and err.count("\n") == 1
    )
    assert not out.parent.exists()


def test_synth_planned_size_is_enough_and_not_wasteful(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check uses the real planned size: a disk with exactly the file's size plus the
    stated header margin is accepted, one with 1 MiB less than the tensor data is refused, for
    a new file and for a replacement alike (which leaves the old file whole)."""
    src = synth_model("qwen3moe", "small", tmp_path / "a.gguf", seed=1)
    size = src.stat().st_size
    data = sum(t.nbytes for t in ModelSpec.from_gguf(src).tensors.values())
    _fake_free(monkeypatch, data - (1 << 20))
    with pytest.raises(InsufficientDiskSpaceError):
        synth_model("qwen3moe", "small", tmp_path / "b.gguf", seed=1)
    assert not (tmp_path / "b.gguf").exists()
    # replacing a file writes the new one beside it first: the old file's bytes are not counted
    # as free, and a refused replacement leaves the old file whole
    before = src.read_bytes()
    with pytest.raises(InsufficientDiskSpaceError):
        synth_model("qwen3moe", "small", src, seed=2)
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]
    _fake_free(monkeypatch, size + 8 * (1 << 20))
    synth_model("qwen3moe", "small", tmp_path / "c.gguf", seed=1)
    assert (tmp_path / "c.gguf").read_bytes() == src.read_bytes()


def test_pack_refuses_before_writing(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = tiny_models["mixtral"]
    ok = pack_model(src, tmp_path / "ok.estream", progress=False)
    used = sum(f.stat().st_size for f in (tmp_path / "ok.estream").iterdir())
    planned = planned_pack_bytes(ModelSpec.from_gguf(src))
    assert used <= planned <= used + (2 << 20), (used, planned)
    assert ok.experts_bytes < planned
    _fake_free(monkeypatch, used - 4096)
    dst = tmp_path / "m.estream"
    with pytest.raises(InsufficientDiskSpaceError, match=r"packing mixtral\.gguf needs"):
        pack_model(src, dst, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.estream"]  # no tmp dir left
    assert pack_main([str(src), "-o", str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("estream-pack: error: packing mixtral.gguf needs ") and err.count("\n") == 1
    )
    assert not dst.exists()


def _peaks(tmp_path: Path, n_layers: int) -> tuple[int, int, int]:
    dims = {"n_layers": n_layers, "n_embd": 256, "n_ff_exp": 256, "n_experts": 16, "n_vocab": 1000}
    tracemalloc.start()
    try:
        src = synth_model("olmoe", "small", tmp_path / f"m{n_layers}.gguf", vocab="-", dims=dims)
        _, peak_synth = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        pack_model(src, tmp_path / f"m{n_layers}.estream", progress=False, chunk_bytes=1 << 20)
        _, peak_pack = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak_synth, peak_pack, src.stat().st_size


def test_memory_does_not_grow_with_the_model(tmp_path: Path) -> None:
    """Synthesis holds one tensor at a time and packing a layer or a chunk of records: the
    Python-heap peak (numpy arrays included) of a model with 5x the layers is about the same."""
    synth6, pack6, size6 = _peaks(tmp_path, 6)
    synth30, pack30, size30 = _peaks(tmp_path, 30)
    layer = size30 // 30  # one layer's tensors
    assert size30 > 4.5 * size6
    assert synth30 < synth6 + layer, (synth6, synth30, layer)
    assert pack30 < pack6 + layer, (pack6, pack30, layer)
