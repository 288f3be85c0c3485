"""The architecture registry, the generic layer loop (dense layers included) and the profile's
per-layer non-expert times."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import numpy as np
import pytest

from estream import UnsupportedModelError
from estream.engine import load
from estream.models import ARCHITECTURES, architecture
from estream.models.ops import Ops
from estream.models.weights import FFN, MoE, Weights, bind_ffn, bind_head, bind_moe
from estream.packed import ExpertLayer, PackedModel
from estream.profiling import _layer_profiles
from estream_layout import ModelSpec, pack_model, synth_model


def _expert_layer(index: int, n_experts: int = 4) -> ExpertLayer:
    order = np.arange(n_experts, dtype=np.int32)
    return ExpertLayer(index, n_experts, order, order, 0, 4096, {}, None)


def test_profile_reads_non_expert_time_by_model_layer() -> None:
    # Layers 0 and 2 are dense, 1 and 3 have experts. The engine reports one non-expert time
    # per model layer; each MoE layer's T_ne is its own time plus the dense layers just before.
    model = SimpleNamespace(layers={1: _expert_layer(1), 3: _expert_layer(3)})
    res = SimpleNamespace(reads=[], records=[], metrics={"layer_t_ne_s": [1.0, 2.0, 4.0, 8.0]})
    profiles = _layer_profiles(res, model, 2)  # type: ignore[arg-type]
    assert [p.t_ne for p in profiles] == [1.0 + 2.0, 4.0 + 8.0]
    assert [p.layer for p in profiles] == [0, 1]


def test_profile_of_an_all_moe_model_is_unchanged() -> None:
    model = SimpleNamespace(layers={i: _expert_layer(i) for i in range(3)})
    res = SimpleNamespace(reads=[], records=[], metrics={"layer_t_ne_s": [0.5, 0.25, 0.125]})
    profiles = _layer_profiles(res, model, 4)  # type: ignore[arg-type]
    assert [p.t_ne for p in profiles] == [0.5, 0.25, 0.125]


def test_registry_names_llama_cpp_architectures() -> None:
    assert set(ARCHITECTURES) == {
        "olmoe",
        "qwen3moe",
        "llama",
        "deepseek2",
        "lfm2moe",
        "smallthinker",
        "gpt-oss",
    }
    for name, module in ARCHITECTURES.items():
        assert callable(module.bind) and callable(module.layer), name


def test_an_architecture_without_a_graph_is_a_clear_error() -> None:
    spec = SimpleNamespace(arch="qwen2moe")
    with pytest.raises(UnsupportedModelError, match=r"'qwen2moe' has no engine graph.*olmoe"):
        architecture(spec)  # type: ignore[arg-type]


# -- a model whose first layer is dense ----------------------------------------------------------
# The tiny synthetic deepseek2 and lfm2moe models have a leading dense layer (and deepseek2
# shared experts, lfm2moe a sigmoid router with a selection bias). Their mixers (MLA, short
# convolutions) are not what this test is about: this stand-in architecture runs only the FFN
# half of each layer, which is enough to drive the engine's loop over dense and MoE layers.
@attrs.frozen
class _FfnOnly:
    ffn_norm: np.ndarray = attrs.field(eq=False)
    moe: MoE | None
    ffn: FFN | None  # the dense FFN, or the shared experts of an MoE layer (if any)


class _FfnOnlyArchitecture:
    ATTENTION_AUTO = "f32"  # (no attention at all)

    @staticmethod
    def bind(model: PackedModel) -> Weights[_FfnOnly]:
        layers = []
        for i in range(model.hparams.n_layers):
            norm = model.dense(f"blk.{i}.ffn_norm.weight").f32()
            if i in model.layers:
                shexp = model.has(f"blk.{i}.ffn_gate_shexp.weight")
                shared = bind_ffn(model, i, "_shexp") if shexp else None
                layers.append(_FfnOnly(norm, bind_moe(model, i), shared))
            else:
                layers.append(_FfnOnly(norm, None, bind_ffn(model, i)))
        lfm2_norm = "token_embd_norm.weight"  # LFM2's final norm
        norm = lfm2_norm if model.has(lfm2_norm) else "output_norm.weight"
        return Weights(bind_head(model, norm), tuple(layers))

    @staticmethod
    def layer(ops: Ops, hp: ModelSpec, w: _FfnOnly, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        h = ops.rms_norm(x, w.ffn_norm)
        if w.moe is None:
            assert w.ffn is not None
            return x + ops.dense_ffn(h, w.ffn)
        if w.ffn is None:
            return x + ops.moe(h, w.moe)
        return x + ops.moe(h, w.moe) + ops.dense_ffn(h, w.ffn)


@pytest.fixture(scope="module", params=["deepseek2", "lfm2moe"])
def dense_lead(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("dense-lead")
    synth_model(request.param, "tiny", d / "m.gguf", seed=5)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


def test_a_dense_layer_reads_nothing_and_streams_like_resident(dense_lead, monkeypatch) -> None:
    spec = PackedModel(dense_lead).hparams
    monkeypatch.setitem(ARCHITECTURES, spec.arch, _FfnOnlyArchitecture())
    assert spec.n_leading_dense == 1 and 0 not in PackedModel(dense_lead).layers
    toks = np.random.default_rng(0).integers(0, spec.n_vocab, size=19)
    with load(dense_lead, mode="resident", act="f32") as eng:
        ref = eng.prefill(toks, all_logits=True)
    with load(dense_lead, G=2, Q=2, B=2, act="f32") as eng:
        got = eng.prefill(toks, all_logits=True)
    assert np.all(np.isfinite(ref.logits))
    rel = np.linalg.norm(got.logits - ref.logits) / np.linalg.norm(ref.logits)
    assert rel <= 1e-5
    assert {r.layer for r in got.reads} == set(spec.moe_layers)  # nothing read for layer 0
    assert {r.layer for r in got.records} == set(spec.moe_layers)
    t_ne = got.metrics["layer_t_ne_s"]
    assert len(t_ne) == spec.n_layers and all(t > 0 for t in t_ne)
    # The dense layer ran: skipping it changes the logits.
    monkeypatch.setitem(ARCHITECTURES, spec.arch, _SkipDense())
    with load(dense_lead, mode="resident", act="f32") as eng:
        skipped = eng.prefill(toks, all_logits=True)
    assert np.linalg.norm(skipped.logits - ref.logits) > 1e-3 * np.linalg.norm(ref.logits)


class _SkipDense(_FfnOnlyArchitecture):
    @staticmethod
    def layer(ops: Ops, hp: ModelSpec, w: _FfnOnly, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        if w.moe is None:
            return x
        return _FfnOnlyArchitecture.layer(ops, hp, w, x, pos)
