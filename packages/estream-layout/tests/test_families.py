"""The family records are where the architecture facts live: `ModelSpec`, the synthesizer and
the views exported for compatibility read them, and SmallThinker's attention pattern, gating and
router/activation facts come out of a file as llama.cpp's loader derives them."""

from __future__ import annotations

from pathlib import Path

import pytest

from estream_layout import (
    ARCHES,
    PRESET_ARCH,
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
    assert spec.arch == "smallthinker" and spec.n_layers == 4
    assert spec.sliding_window == 4096
    assert spec.swa_layers == (1, 2, 3) and spec.nope_layers == (0,)
    assert spec.expert_gating_func == "sigmoid" and spec.expert_weights_norm
    assert spec.router_input == "layer" and spec.expert_glu == "reglu"
    assert spec.rope_type == "neox" and spec.qk_norm == "none"
    assert ModelSpec.from_dict(spec.summary()).summary() == spec.summary()


def test_smallthinker_window_value_and_pattern_key(tiny: Path, tmp_path: Path) -> None:
    """llama.cpp takes 4096 whatever window the file gives, and the pattern from
    attention.sliding_window_pattern (NoPE stays every 4th layer); no window: no sliding and
    RoPE everywhere."""
    spec = ModelSpec.from_gguf(
        mutate_gguf(tiny, tmp_path / "a.gguf", set_kv={S + "attention.sliding_window": 16})
    )
    assert spec.sliding_window == 4096 and spec.swa_layers == (1, 2, 3)
    spec = ModelSpec.from_gguf(
        mutate_gguf(tiny, tmp_path / "b.gguf", set_kv={S + "attention.sliding_window_pattern": 2})
    )
    assert spec.swa_layers == (1, 3) and spec.nope_layers == (0,)
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
