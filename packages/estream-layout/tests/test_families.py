"""The family records are where the architecture facts live: `ModelSpec`, the synthesizer and
the views exported for compatibility read them, and SmallThinker's attention pattern, gating and
router/activation facts come out of a file as llama.cpp's loader derives them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from estream_layout import (
    ARCHES,
    PRESET_ARCH,
    InvalidGGUFError,
    InvalidMetadataError,
    ModelSpec,
    pack_model,
    synth_dims,
    synth_model,
)
from estream_layout.families import BY_ARCH, BY_FAMILY, RECORDS
from estream_layout.gguf_model import FAMILIES, QK_NORM
from estream_layout.testing import DROP, mutate_gguf

S = "smallthinker."


def test_every_family_has_one_record_and_the_views_agree() -> None:
    """One record per family, found by family name and by GGUF architecture; the exported
    FAMILIES / QK_NORM / ARCHES / PRESET_ARCH views are the records' facts."""
    assert tuple(f.name for f in RECORDS) == ARCHES
    assert "smallthinker" in ARCHES
    for f in RECORDS:
        assert BY_FAMILY[f.name] is f and BY_ARCH[f.gguf_arch] is f
        assert FAMILIES[f.gguf_arch] == f.name and QK_NORM[f.name] == f.qk_norm
        for preset in f.published:
            assert PRESET_ARCH[preset] == f.name
            synth_dims(f.name, preset)  # every published preset has dimensions


@pytest.mark.parametrize("arch", ARCHES)
def test_a_synthesized_file_reads_back_with_its_records_facts(arch: str, tmp_path: Path) -> None:
    """The spec of a synthesized file carries its record's RoPE type, q/k norm, router input
    and expert activation."""
    spec = ModelSpec.from_gguf(synth_model(arch, "tiny", tmp_path / "m.gguf", seed=2))
    rec = BY_FAMILY[arch]
    assert spec.family == arch and spec.record is rec
    assert (spec.rope_type, spec.qk_norm) == (rec.rope_type, rec.qk_norm)
    assert (spec.router_input, spec.expert_glu) == (rec.router_input, rec.expert_glu)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("smallthinker", "tiny", tmp_path_factory.mktemp("st") / "t.gguf", seed=1)


def test_smallthinker_tiny_has_llama_cpps_window_pattern(tiny: Path) -> None:
    """With a sliding window, llama.cpp slides layers i % 4 != 0 over 4096 tokens and leaves the
    full layers i % 4 == 0 without RoPE; the router reads the layer input; experts are ReGLU
    under the file's gating (sigmoid here), renormalised."""
    spec = ModelSpec.from_gguf(tiny)
    assert spec.arch == "smallthinker" and spec.n_layers == 3
    assert spec.sliding_window == 4096
    assert spec.swa_layers == (1, 2) and spec.nope_layers == (0,)
    assert spec.expert_gating_func == "sigmoid" and spec.expert_weights_norm
    assert spec.router_input == "layer" and spec.expert_glu == "reglu"
    assert spec.rope_type == "neox" and spec.qk_norm == "none"
    assert ModelSpec.from_dict(spec.summary()).summary() == spec.summary()


@pytest.mark.parametrize(
    ("n_layers", "nope"), [(3, (0,)), (4, ()), (5, (0, 4)), (8, (0, 4)), (9, (0, 4, 8))]
)
def test_smallthinker_nope_layers_follow_llama_cpps_graph(
    tmp_path: Path, n_layers: int, nope: tuple[int, ...]
) -> None:
    """With a window, llama.cpp's graph leaves layers i % 4 == 0 without RoPE, except in a
    model of exactly four layers, where its test `step == n_layer` gives every layer RoPE."""
    path = synth_model("smallthinker", "tiny", tmp_path / "m.gguf", seed=1, n_layers=n_layers)
    spec = ModelSpec.from_gguf(path)
    assert spec.nope_layers == nope
    assert spec.swa_layers == tuple(i for i in range(n_layers) if i % 4)


def test_smallthinker_window_value_and_pattern_key(tiny: Path, tmp_path: Path) -> None:
    """llama.cpp takes 4096 whatever window the file gives, and the pattern from
    attention.sliding_window_pattern (NoPE stays every 4th layer); no window: no sliding and
    RoPE everywhere."""
    spec = ModelSpec.from_gguf(
        mutate_gguf(tiny, tmp_path / "a.gguf", set_kv={S + "attention.sliding_window": 16})
    )
    assert spec.sliding_window == 4096 and spec.swa_layers == (1, 2)
    spec = ModelSpec.from_gguf(
        mutate_gguf(tiny, tmp_path / "b.gguf", set_kv={S + "attention.sliding_window_pattern": 2})
    )
    assert spec.swa_layers == (1,) and spec.nope_layers == (0,)
    spec = ModelSpec.from_gguf(
        mutate_gguf(tiny, tmp_path / "c.gguf", set_kv={S + "attention.sliding_window": DROP})
    )
    assert (spec.sliding_window, spec.swa_layers, spec.nope_layers) == (0, (), ())


@pytest.mark.parametrize(
    ("kv", "needle"),
    [
        ({S + "expert_gating_func": DROP}, "expert_gating_func is missing (smallthinker needs it)"),
        ({S + "expert_gating_func": 3}, "expert_gating_func = 3 is not one llama.cpp defines"),
        ({S + "rope.freq_base_swa": 10000.0}, "rope.freq_base_swa = 10000 differs"),
    ],
)
def test_smallthinker_metadata_llama_cpp_would_misread_is_refused(
    tiny: Path, tmp_path: Path, kv: dict, needle: str
) -> None:
    """A file without the gating function, with an unknown one, or with a RoPE base for the
    sliding layers is refused naming the key, and nothing is written."""
    bad = mutate_gguf(tiny, tmp_path / "bad.gguf", set_kv=kv)
    with pytest.raises(
        InvalidMetadataError,
    ) as info:
        pack_model(bad, tmp_path / "bad.estream", progress=False)
    assert needle in str(info.value)
    assert not (tmp_path / "bad.estream").exists()


def test_smallthinker_published_presets_are_the_model_cards(tmp_path: Path) -> None:
    """The full-size presets have the published shapes (layers, width, heads, experts)."""
    d = synth_dims("smallthinker", "smallthinker-4b-a0.6b")
    assert (d.n_layers, d.n_embd, d.n_head, d.n_head_kv, d.head_dim) == (32, 1536, 12, 2, 128)
    assert (d.n_experts, d.n_experts_used, d.n_ff_exp, d.n_vocab) == (32, 4, 768, 151936)
    d = synth_dims("smallthinker", "smallthinker-21b-a3b")
    assert (d.n_layers, d.n_embd, d.n_head, d.n_head_kv) == (52, 2560, 28, 4)
    assert (d.n_experts, d.n_experts_used, d.n_ff_exp) == (64, 6, 768)
    with pytest.raises(ValueError, match="use --arch smallthinker"):
        synth_dims("olmoe", "smallthinker-21b-a3b")


G = "gpt-oss."


def _without_tensor(src: Path, dst: Path, name: str) -> Path:
    """A copy of the GGUF `src` without tensor `name`."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        if t.name != name:
            data = np.asarray(t.data)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def gpt_oss_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("gpt-oss", "tiny", tmp_path_factory.mktemp("go") / "t.gguf", seed=1)


def test_gpt_oss_tiny_reads_as_llama_cpp_loads_it(gpt_oss_tiny: Path, tmp_path: Path) -> None:
    """gpt-oss: the even layers slide over attention.sliding_window tokens, every layer takes
    NeoX RoPE (YaRN-scaled here), softmax over the selected experts (renormalised softmax),
    SwiGLU-OAI experts; the biases, sinks and post-attention norm are in the file with
    llama.cpp's names and shapes, and the spec survives the manifest round trip."""
    spec = ModelSpec.from_gguf(gpt_oss_tiny)
    assert spec.arch == "gpt-oss" and spec.family == "gpt-oss" and spec.n_layers == 2
    assert spec.sliding_window == 8 and spec.swa_layers == (0,) and spec.nope_layers == ()
    assert spec.rope_scaling_type == "yarn" and spec.rope_freq_scale == 0.25
    assert spec.rope_n_ctx_orig == 32 and spec.rope_freq_base == 150000.0
    assert spec.expert_gating_func == "softmax" and spec.expert_weights_norm
    assert spec.expert_glu == "swiglu_oai" and spec.router_input == "ffn_norm"
    assert spec.expert_type == "MXFP4"  # the family's default, as published
    shapes = {n: t.shape for n, t in spec.tensors.items()}
    assert shapes["blk.1.attn_sinks.weight"] == (4,)
    assert shapes["blk.1.attn_q.bias"] == (64,) and shapes["blk.1.attn_k.bias"] == (32,)
    assert shapes["blk.1.attn_output.bias"] == (64,) and shapes["blk.1.ffn_gate_inp.bias"] == (8,)
    assert shapes["blk.0.ffn_gate_exps.bias"] == (8, 64) == shapes["blk.0.ffn_up_exps.bias"]
    assert shapes["blk.0.ffn_down_exps.bias"] == (8, 64)
    assert "blk.0.post_attention_norm.weight" in shapes and "blk.0.ffn_norm.weight" not in shapes
    assert "output.weight" in shapes
    assert ModelSpec.from_dict(spec.summary()).summary() == spec.summary()
    four = synth_model("gpt-oss", "tiny", tmp_path / "four.gguf", seed=1, n_layers=4)
    assert ModelSpec.from_gguf(four).swa_layers == (0, 2)


@pytest.mark.parametrize(
    ("kv", "drop", "needle"),
    [
        ({G + "attention.sliding_window": DROP}, None, "attention.sliding_window is missing"),
        ({}, "blk.1.attn_sinks.weight", "blk.1.attn_sinks.weight is missing"),
        ({}, "blk.0.ffn_down_exps.bias", "blk.0.ffn_down_exps.bias is missing"),
        ({}, "blk.0.post_attention_norm.weight", "blk.0.post_attention_norm.weight is missing"),
    ],
)
def test_gpt_oss_file_without_what_llama_cpp_requires_is_refused(
    gpt_oss_tiny: Path, tmp_path: Path, kv: dict, drop: str | None, needle: str
) -> None:
    """A gpt-oss file without its window, a sink, an expert bias or the post-attention norm
    is refused naming what is missing, and nothing is written."""
    bad = mutate_gguf(gpt_oss_tiny, tmp_path / "kv.gguf", set_kv=kv)
    if drop is not None:
        bad = _without_tensor(bad, tmp_path / "bad.gguf", drop)
    with pytest.raises((InvalidMetadataError, InvalidGGUFError)) as info:
        pack_model(bad, tmp_path / "bad.estream", progress=False)
    assert needle in str(info.value)
    assert not (tmp_path / "bad.estream").exists()


def test_synthesized_experts_default_to_the_familys_type(tmp_path: Path) -> None:
    """Without an expert type, gpt-oss's experts are MXFP4 (its record's) and another family's
    Q4_0; an explicit type wins for gpt-oss too."""
    assert BY_FAMILY["gpt-oss"].expert_type == "MXFP4"
    olmoe = ModelSpec.from_gguf(synth_model("olmoe", "tiny", tmp_path / "o.gguf", seed=1))
    assert olmoe.expert_type == "Q4_0"
    q8 = synth_model("gpt-oss", "tiny", tmp_path / "g.gguf", seed=1, expert_type="Q8_0")
    assert ModelSpec.from_gguf(q8).expert_type == "Q8_0"


def test_gpt_oss_published_preset_is_the_model_card() -> None:
    """The gpt-oss-20b preset has the published shape: 24 layers, d 2880, 64 q / 8 kv heads of
    64, 32 experts top-4 of 2880, window 128, YaRN 32 over 4096."""
    d = synth_dims("gpt-oss", "gpt-oss-20b")
    assert (d.n_layers, d.n_embd, d.n_head, d.n_head_kv, d.head_dim) == (24, 2880, 64, 8, 64)
    assert (d.n_experts, d.n_experts_used, d.n_ff_exp, d.n_vocab) == (32, 4, 2880, 201088)
    assert (d.sliding_window, d.yarn_factor, d.yarn_orig_ctx) == (128, 32.0, 4096)
    with pytest.raises(ValueError, match="use --arch gpt-oss"):
        synth_dims("olmoe", "gpt-oss-20b")


def _llama_cpp_tensor_names(gguf_arch: str, n_layers: int) -> set[str]:
    """Every tensor name gguf-py (llama.cpp's own tables) defines for `gguf_arch`, with the
    ``.weight`` / ``.bias`` suffixes."""
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[gguf_arch]
    out: set[str] = set()
    for t in gguf.MODEL_TENSORS[arch]:
        base = gguf.TENSOR_NAMES[t]
        for bid in range(n_layers) if "{bid}" in base else [0]:
            out |= {base.format(bid=bid) + s for s in (".weight", ".bias")}
    return out


@pytest.mark.parametrize("arch", ARCHES)
def test_every_tensor_a_record_names_is_llama_cpps_name(arch: str, tmp_path: Path) -> None:
    """Each tensor a synthesized file of the family holds (the names its record requires and
    writes) is a name llama.cpp's tables define for the GGUF architecture: a name of the
    engine's own would never be found in a file llama.cpp's converter wrote."""
    path = synth_model(arch, "tiny", tmp_path / "m.gguf", seed=2)
    spec = ModelSpec.from_gguf(path)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    unknown = names - _llama_cpp_tensor_names(spec.record.gguf_arch, spec.n_layers)
    assert not unknown, sorted(unknown)
