"""`EngineOptions`: an engine's options checked once, when they are made, before anything is
opened; the engine takes them whole or as keyword arguments; a budget's configuration is
computed once per engine (the configurator's memory figure travels in `StreamConfig`)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest

import estream
import estream.config as config
from estream import BadRequestError, EngineOptions, memory
from estream.config import PROFILE_TOKENS
from estream.engine import PIN_AUTO_MARGIN, pass_bytes_per_token
from estream.packed import PackedModel
from estream_layout import pack_model, synth_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("options")
    synth_model("olmoe", "tiny", d / "m.gguf", seed=7)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"dense_ops": "dsp"}, "dense_ops must be one of host, backend, got 'dsp'"),
        ({"act": "q4"}, "act must be one of q8, f32, got 'q4'"),
        ({"attention": "f16"}, "attention must be one of auto, f32, bf16, bf16-pv, got 'f16'"),
        ({"backend": "gpu"}, "backend must be one of host, host-process, hexagon, got 'gpu'"),
        ({"mode": "fast"}, "mode must be one of stream, resident, naive, layer, got 'fast'"),
        ({"schedule": "late"}, "schedule must be one of early, after-routing, ondemand"),
        ({"G": 0}, "G must be a positive integer, got 0"),
        ({"Q": 2.5}, "Q must be a positive integer, got 2.5"),
        ({"B": True}, "B must be a positive integer, got True"),
        ({"n_threads": -1}, "n_threads must be a positive integer, got -1"),
        ({"budget_tokens": 0}, "budget_tokens must be an int >= 1, got 0"),
        ({"budget": "lots"}, "cannot read memory size 'lots'"),
    ],
)
def test_a_bad_option_is_refused_before_anything_opens(
    kw: dict[str, object], message: str, tmp_path: Path
) -> None:
    """Each bad option raises `BadRequestError` naming it and its value, from the options
    alone and from `estream.load` before the pack is opened (the path does not exist)."""
    with pytest.raises(BadRequestError, match=message.replace(".", r"\.")):
        EngineOptions(**kw)  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match=message.replace(".", r"\.")):
        estream.load(tmp_path / "absent.estream", **kw)


def test_options_whole_or_as_keywords(model: Path) -> None:
    """`Engine(path, options)` and `Engine(path, **keywords)` run the same configuration and
    give the same logits; giving both is a TypeError; an unknown keyword is a TypeError."""
    opts = EngineOptions(mode="stream", G=2, Q=2, B=3, act="f32", budget="1GiB")
    assert opts.budget == 1 << 30 and opts.n_threads is None
    with estream.Engine(model, opts) as a, estream.load(model, **attrs.asdict(opts)) as b:
        assert a.options == b.options == opts
        assert (a.config, a.dense_ops, a.budget) == (b.config, b.dense_ops, 1 << 30)
        ra, rb = a.prefill([1, 2, 3]), b.prefill([1, 2, 3])
        assert (ra.logits == rb.logits).all()
    with pytest.raises(TypeError, match="not both"):
        estream.Engine(model, opts, mode="resident")
    with pytest.raises(TypeError):
        estream.load(model, groups=2)


def test_a_budget_is_configured_once(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget, loading runs the configurator once and `default_batch_tokens` uses the
    memory figure it predicted (kept in `StreamConfig.memory_bytes`) without running it
    again: allowance = budget - predicted + the profile pass's activations, where the
    prediction for a ``budget_tokens`` longer than the profile's pass holds that prompt's
    extra activations (`StreamConfig.extra_bytes`), which are not counted twice."""
    calls: list[tuple[int, int | None, str]] = []
    per = pass_bytes_per_token(PackedModel(model).hparams)
    predicted = (1 << 30) - 2000 * per  # an allowance inside the batch clamp
    tokens = PROFILE_TOKENS + 1000

    def configure(
        m: PackedModel,
        budget: int,
        tokens: int | None = None,
        schedule: str = "early",
        read_margin: float | None = None,
    ) -> SimpleNamespace:
        assert read_margin is None  # the configurator's default
        calls.append((budget, tokens, schedule))
        extra = config.prompt_extra_bytes(m, tokens)
        return SimpleNamespace(G=2, Q=2, B=3, memory_bytes=predicted + extra, extra_bytes=extra)

    monkeypatch.setattr(config, "configure_for_budget", configure)
    with estream.load(model, budget="1GiB", budget_tokens=tokens) as eng:
        assert calls == [(1 << 30, tokens, "early")]
        extra = 1000 * per
        assert eng.config == config.StreamConfig(
            2, 2, 3, "budget", predicted + extra, extra_bytes=extra
        )
        assert eng.default_batch_tokens() == 2000 + PROFILE_TOKENS
        assert calls == [(1 << 30, tokens, "early")]  # not run again
    with estream.load(model, budget="1GiB", schedule="after-routing"):
        assert calls[-1] == (1 << 30, None, "after-routing")  # the engine's schedule


def test_after_routing_is_configured_with_reads_from_layer_start_for_a_pre_attention_router(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`configure_for_budget` tells the configurator where a model's router runs: for
    SmallThinker (router on the layer's input) ``after-routing`` is predicted as ``early``
    (reads from layer start, overlapping attention); for OLMoE (router after attention) its
    reads wait for the non-expert work, so on the same read-bound profile with non-expert time
    it predicts strictly more; ``ondemand`` is configured as ``early``."""
    import estream_sched as es
    from estream.packed import PackedModel

    synth_model("smallthinker", "tiny", tmp_path / "st.gguf", seed=7)
    pack_model(tmp_path / "st.gguf", tmp_path / "st.estream", progress=False)
    profile = es.synthetic_profile(
        es.SyntheticSpec(n_layers=4, t_ne=5e-3, stream_bw=2e8, peak_bw=4e8), seed=3
    )
    monkeypatch.setattr(config, "stored_profile", lambda m: profile)
    st, olmoe = PackedModel(tmp_path / "st.estream"), PackedModel(model)
    assert st.hparams.router_input == "layer" and olmoe.hparams.router_input == "ffn_norm"
    budget = 1 << 30

    def predicted(m: PackedModel, schedule: str) -> float:
        return float(config.configure_for_budget(m, budget, None, schedule).predicted_s)

    early = predicted(olmoe, "early")
    assert predicted(st, "early") == early == predicted(olmoe, "ondemand")
    assert predicted(st, "after-routing") == early
    assert predicted(olmoe, "after-routing") > early


def test_pin_is_checked_against_the_mode_and_the_budget(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pin``: a size or "auto"; refused where nothing streams, "auto" without a budget's
    prediction, and a size over what the budget leaves beyond the predicted memory (the
    message gives the figures). "auto" pins that room less `PIN_AUTO_MARGIN` of the budget,
    and the engine's memory and the batch allowance count the pins."""
    with pytest.raises(BadRequestError, match="cannot read memory size 'some'"):
        EngineOptions(pin="some")
    with pytest.raises(BadRequestError, match="pin keeps streamed experts; mode 'resident'"):
        estream.load(model, mode="resident", pin="1MiB")
    with pytest.raises(BadRequestError, match='pin="auto" pins what the memory budget leaves'):
        estream.load(model, pin="auto")
    margin = int(PIN_AUTO_MARGIN * (1 << 30))
    predicted = (1 << 30) - margin - (3 << 20)  # the budget leaves 3 MiB over the margin

    def configure(
        m: PackedModel,
        budget: int,
        tokens: int | None = None,
        schedule: str = "early",
        read_margin: float | None = None,
    ) -> SimpleNamespace:
        extra = config.prompt_extra_bytes(m, tokens)  # as `configure_for_budget` counts it
        return SimpleNamespace(G=2, Q=2, B=3, memory_bytes=predicted + extra, extra_bytes=extra)

    monkeypatch.setattr(config, "configure_for_budget", configure)
    room = memory.format_bytes(margin + (3 << 20))
    msg = f"pin 200.00 MiB does not fit the budget: 1.00 GiB leaves {room} over the run's"
    with pytest.raises(BadRequestError, match=re.escape(msg)):
        estream.load(model, budget="1GiB", pin="200MiB")
    # for a longer prompt than the profile's, its activations (pass_bytes_per_token) too
    per = pass_bytes_per_token(PackedModel(model).hparams)
    longer = 3 * (1 << 20) // per + 1  # tokens whose activations take the 3 MiB
    with pytest.raises(BadRequestError, match=re.escape(f"for {PROFILE_TOKENS + longer} tokens")):
        estream.load(model, budget="1GiB", budget_tokens=PROFILE_TOKENS + longer, pin=f"{margin}")
    with estream.load(model, budget="1GiB", budget_tokens=PROFILE_TOKENS + longer, pin="auto") as e:
        assert e.pin_bytes == 0
    with estream.load(model, budget="1GiB", pin="auto") as eng:
        assert eng.pin_bytes == 3 << 20
        pinned = eng.experts.pinned_bytes
        assert pinned > 0  # the tiny model's experts fit: every group is pinned
        layers = eng.model.layers.values()
        assert pinned == sum(-(-lay.n_experts // 2) for lay in layers) * 2 * sum(
            size for _, size in eng.model.plane_extents
        )
        assert eng.experts.memory_bytes == eng.experts.arena.total_bytes + pinned
        per = pass_bytes_per_token(eng.hp)
        want = ((1 << 30) - predicted - pinned + PROFILE_TOKENS * per) // per
        assert eng.default_batch_tokens() == max(64, min(8192, want))


def test_a_corrupt_pinned_record_is_refused_at_load(model: Path, tmp_path: Path) -> None:
    """With ``verify``, a pinned group is checked as it is read at load: a flipped byte in the
    first layer's group 0 raises `ChecksumError` naming that layer and group, and the failed
    load leaves no thread behind."""
    import shutil
    import threading

    from estream_arena import ChecksumError  # as a streamed read's

    root = tmp_path / "m.estream"
    shutil.copytree(model, root)
    first = PackedModel(root).layers
    lay = first[min(first)]
    with open(root / "experts.bin", "r+b") as f:
        f.seek(lay.offset + 100)
        b = f.read(1)
        f.seek(lay.offset + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    threads = threading.active_count()
    with pytest.raises(ChecksumError, match=f"layer {lay.index}, group 0, .* has crc32"):
        estream.load(root, G=2, Q=2, B=3, pin="1MiB", verify=True)
    assert threading.active_count() == threads
    with estream.load(root, G=2, Q=2, B=3, pin="1MiB") as eng:  # unchecked: it loads
        assert eng.experts.pinned_bytes > 0
