from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from estream_layout import ARCHES, InvalidGGUFError, ModelSpec, dequantize_tensor, synth_model
from estream_layout.synth import generate_bpe_vocab


def test_deterministic_per_seed(tmp_path: Path) -> None:
    a = synth_model("olmoe", "tiny", tmp_path / "a.gguf", seed=5).read_bytes()
    b = synth_model("olmoe", "tiny", tmp_path / "b.gguf", seed=5).read_bytes()
    c = synth_model("olmoe", "tiny", tmp_path / "c.gguf", seed=6).read_bytes()
    assert a == b and a != c


@pytest.mark.parametrize("arch", ARCHES)
def test_routing_is_skewed(arch: str, tiny_models: dict[str, Path]) -> None:
    """Hot experts (router rows along the embeddings' shared direction) get more than their fair
    share of routes, while every expert is still reached (load-balanced-model-like)."""
    spec = ModelSpec.from_gguf(tiny_models[arch])
    # hidden states as the first layer sees them: RMS-normalised token embeddings
    x = dequantize_tensor(spec, "token_embd.weight").astype(np.float64)
    x /= np.sqrt((x**2).mean(axis=1, keepdims=True))
    shared = x.mean(axis=0) / np.linalg.norm(x.mean(axis=0))
    hot_load = []
    for layer in spec.moe_layers:
        w = dequantize_tensor(spec, f"blk.{layer}.ffn_gate_inp.weight").astype(np.float64)
        logits = x @ w.T
        if f"blk.{layer}.exp_probs_b.bias" in spec.tensors:  # lfm2moe: selection bias
            bias = dequantize_tensor(spec, f"blk.{layer}.exp_probs_b.bias")
            logits = 1 / (1 + np.exp(-logits)) + bias
        top = np.argsort(-logits, axis=1)[:, : spec.n_experts_used]
        load = np.bincount(top.ravel(), minlength=spec.n_experts) / top.size * spec.n_experts
        hot = int(np.argmax(w @ shared))
        assert load[hot] > 1.1, (layer, load)  # more than its fair share (1.0)
        assert (load > 0).all(), load  # every expert is reached
        hot_load.append(load[hot])
    assert np.mean(hot_load) > 1.25, hot_load


def test_weights_keep_activations_order_one(tiny_models: dict[str, Path]) -> None:
    spec = ModelSpec.from_gguf(tiny_models["qwen3moe"])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, spec.n_embd))
    for name in ("blk.0.ffn_gate_exps.weight", "blk.1.attn_q.weight", "output.weight"):
        w = dequantize_tensor(spec, name).astype(np.float64)
        w = w[0] if w.ndim == 3 else w
        y = x @ w.T
        assert 0.3 < y.std() < 3.0, (name, y.std())
    norm = dequantize_tensor(spec, "blk.0.attn_norm.weight")
    assert np.abs(norm - 1).max() < 0.2


def test_generated_vocab_is_valid_bpe() -> None:
    v = generate_bpe_vocab(301, seed=1)
    tokens = v["tokenizer.ggml.tokens"]
    assert len(tokens) == 301 and len(set(tokens)) == 301
    have = set(tokens[:256])
    for m in v["tokenizer.ggml.merges"]:
        left, right = m.split(" ")
        assert left in have and right in have
        have.add(left + right)
    assert set(tokens[:-2]) == have
    assert v["tokenizer.ggml.token_type"][-2:] == [3, 3]
    assert v["tokenizer.ggml.eos_token_id"] == 299


def test_vocab_copied_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = gguf.GGUFWriter(tmp_path / "vocab.gguf", "gpt2")
    toks = [chr(0x100 + i) for i in range(40)] + ["ab", "abc"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(toks)
    w.add_token_types([1] * len(toks))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = synth_model("mixtral", "tiny", tmp_path / "m.gguf", vocab=tmp_path / "vocab.gguf")
    r = gguf.GGUFReader(p)
    assert r.fields["tokenizer.ggml.tokens"].contents() == toks
    assert r.fields["tokenizer.ggml.bos_token_id"].contents() == 3
    spec = ModelSpec.from_gguf(p)
    assert spec.n_vocab == 42 and spec.tensors["token_embd.weight"].shape == (42, 64)
    # a vocabulary asked for by name that does not exist is an error, not a silent substitute
    with pytest.raises(InvalidGGUFError, match=r"missing\.gguf: no such file"):
        synth_model("mixtral", "tiny", tmp_path / "m2.gguf", vocab=tmp_path / "missing.gguf")
    assert not (tmp_path / "m2.gguf").exists()


def test_overrides_and_types(tmp_path: Path) -> None:
    p = synth_model(
        "olmoe", "tiny", tmp_path / "m.gguf", n_layers=5, expert_type="Q8_0", output_type="Q4_0"
    )
    s = ModelSpec.from_gguf(p)
    assert s.n_layers == 5 and s.moe_layers == (0, 1, 2, 3, 4) and s.expert_type == "Q8_0"
    assert s.tensors["output.weight"].ggml_type == "Q4_0"
    with pytest.raises(TypeError, match="unknown synth dimension"):
        synth_model("olmoe", "tiny", tmp_path / "x.gguf", n_layer=5)
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size"):
        synth_model("qwen3moe", "tiny", tmp_path / "x.gguf", dense_type="Q4_K")
    with pytest.raises(ValueError, match="unknown preset"):
        synth_model("olmoe", "huge", tmp_path / "x.gguf")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--seed", "-5"], "seed -5 must be an integer from 0 to 2**63 - 1"),
        (["--seed", str(2**64)], "seed 18446744073709551616 must be"),
        (["--vocab", "/etc/passwd"], "/etc/passwd is not a GGUF file"),
        (["--vocab", "/"], "vocabulary /: not a regular file"),
        (["--vocab", "NOVOCAB"], "has no tokenizer"),
        (["--vocab", "TRUNCATED"], "is truncated inside its header"),
    ],
)
def test_bad_synth_arguments_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    """`estream-synth` (and `estream synth`, which runs it) refuses a negative or huge seed and
    a vocabulary that is not a GGUF with a tokenizer: exit 2, one line, no output file."""
    from estream_layout.cli import synth_main

    novocab = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(novocab, "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(synth_model("olmoe", "tiny", tmp_path / "v.gguf").read_bytes()[:2000])
    args = [{"NOVOCAB": str(novocab), "TRUNCATED": str(truncated)}.get(a, a) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "m.gguf"
    rc = synth_main(["--arch", "olmoe", "--preset", "tiny", "-o", str(out), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("estream-synth: error: ") and needle in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_synth_seed_is_checked_in_the_api(tmp_path: Path) -> None:
    """The API refuses what the command refuses, with the same error class."""
    from estream_layout import InvalidArgumentError

    for seed in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidArgumentError, match="seed"):
            synth_model("olmoe", "tiny", tmp_path / "m.gguf", seed=seed)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_an_interrupted_synth_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF is written under a temporary name and renamed into place when complete: a run
    stopped mid-write leaves nothing new in the directory and an existing file as it was; a
    complete run leaves only the file, with the mode a new file gets under the umask."""
    import os

    from estream_layout import synth

    out = tmp_path / "m.gguf"
    out.write_bytes(b"an older file")
    calls = {"n": 0}
    real = synth._tensor_data

    def stop_at_the_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(synth, "_tensor_data", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        synth_model("olmoe", "tiny", out, seed=0)
    assert calls["n"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert out.read_bytes() == b"an older file"
    monkeypatch.setattr(synth, "_tensor_data", real)
    umask = os.umask(0o027)
    try:
        synth_model("olmoe", "tiny", out, seed=0)
    finally:
        os.umask(umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert out.stat().st_mode & 0o777 == 0o640
    assert ModelSpec.from_gguf(out).n_layers > 0


@pytest.mark.parametrize(
    "qtype", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q4_1", "Q5_0", "Q5_1"]
)
def test_random_weights_of_every_type_centre_on_zero(tmp_path: Path, qtype: str) -> None:
    """Synthesized expert and dense matrices of each type have values centred on zero and rows
    pointing in unrelated directions (mean |cosine| between rows within twice that of independent
    random vectors, sqrt(2 / (pi K))), at the usual scale: a shared offset (a K-quant min drawn at random puts every element's mean at ~0.7 of
    its RMS) would align every token's hidden state and send every token to the same experts."""
    dims = {"n_embd": 256, "n_ff_exp": 256, "n_head": 4, "head_dim": 64, "n_ff": 256}
    src = synth_model("qwen3moe", "tiny", tmp_path / "m.gguf", expert_type=qtype,
                      dense_type=qtype, dims=dims, vocab="-")  # fmt: skip
    spec = ModelSpec.from_gguf(src)
    for name in ("blk.0.ffn_up_exps.weight", "blk.1.attn_q.weight"):
        w = dequantize_tensor(spec, name).astype(np.float64)
        w = w.reshape(-1, w.shape[-1])[:64]
        assert abs(w.mean()) < 0.1 * w.std(), (name, w.mean(), w.std())
        u = w / np.linalg.norm(w, axis=1, keepdims=True)
        cos = u @ u.T
        off = np.abs(cos[~np.eye(len(u), dtype=bool)]).mean()
        assert off < 2 * np.sqrt(2 / (np.pi * w.shape[1])), (name, off)
        assert 0.3 < w.std() * np.sqrt(w.shape[1]) < 3.0, (name, w.std())
