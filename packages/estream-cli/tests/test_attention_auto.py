"""``attention="auto"``: under act q8 where the kernel set running the dense ops multiplies bf16
natively (`estream_htp.native_bf16_attention`) the architecture's ``ATTENTION_AUTO`` (bf16 where
the parity table shows its error within 5 % of fp32 attention's, else bf16-pv where it shows
that mode's, else f32), fp32 otherwise and
always under act f32; the engine, its results and ``--json`` report the precision that ran. It is
the default."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import estream
import estream_htp as htp
from estream import BadRequestError, EngineOptions
from estream.engine import ATTENTION, resolve_attention
from estream.models import ARCHITECTURES
from estream_cli.main import main
from estream_htp import _core
from estream_layout import pack_model, synth_model

TOKENS = list(range(3, 70))


def _cpu_has_avx512_bf16() -> bool:
    """From the kernel's view of the CPU, independently of estream_htp's own detection."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    return bool(flags) and {"avx512f", "avx512_bf16"} <= set(flags.group(1).split())


NATIVE = htp.native_bf16_attention()
NATIVE_CPU = _cpu_has_avx512_bf16()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("attn_auto")
    synth_model("olmoe", "tiny", d / "m.gguf", seed=11)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


@pytest.fixture
def simd_avx2() -> Iterator[None]:
    """The default backend on the AVX2 kernel set (no native bf16 attention) for one test."""
    if not htp.simd_supported("avx2"):
        pytest.skip("this CPU lacks AVX2 (hardware)")
    old = htp.simd_level()
    _core._set_simd_level("avx2")
    try:
        yield
    finally:
        _core._set_simd_level(old)


def _logits(model: Path, **kw: object) -> tuple[np.ndarray, str, str]:
    with estream.load(model, **kw) as eng:
        r = eng.prefill(TOKENS, all_logits=True)
        return np.asarray(r.logits), eng.attention, r.metrics["attention"]


def test_auto_is_the_default_and_a_bad_value_lists_the_choices(tmp_path: Path) -> None:
    assert EngineOptions().attention == "auto" and ATTENTION == ("auto", "f32", "bf16", "bf16-pv")
    msg = "attention must be one of auto, f32, bf16, bf16-pv, got 'fp16'"
    with pytest.raises(BadRequestError, match=msg):
        EngineOptions(attention="fp16")
    with pytest.raises(BadRequestError, match=msg):
        estream.load(tmp_path / "absent.estream", attention="fp16")
    with pytest.raises(BadRequestError, match=msg):
        resolve_attention("fp16", "q8")


def test_resolve_attention_by_activation_format_and_backend() -> None:
    """Explicit values as they are; auto: the architecture's bf16 or bf16-pv only for q8 on a
    native kernel set, and a value other than bf16, bf16-pv or f32 for it refused."""
    native, emulated = SimpleNamespace(simd="avx512"), SimpleNamespace(simd="avx2")
    for dense in (native, emulated, None):
        assert resolve_attention("f32", "q8", dense) == "f32"  # type: ignore[arg-type]
        assert resolve_attention("bf16", "f32", dense) == "bf16"  # type: ignore[arg-type]
        assert resolve_attention("bf16-pv", "q8", dense) == "bf16-pv"  # type: ignore[arg-type]
        assert resolve_attention("auto", "f32", dense) == "f32"  # type: ignore[arg-type]
    hvx = SimpleNamespace(simd="hvx")  # the hexagon executor's kernel set
    for arch in ("bf16", "bf16-pv", "f32"):
        assert resolve_attention("auto", "q8", emulated, native=arch) == "f32"  # type: ignore[arg-type]
        assert resolve_attention("auto", "q8", hvx, native=arch) == "f32"  # type: ignore[arg-type]
        assert resolve_attention("auto", "f32", native, native=arch) == "f32"  # type: ignore[arg-type]
        assert resolve_attention("bf16-pv", "q8", native, native=arch) == "bf16-pv"  # type: ignore[arg-type]
    for arch in ("bf16", "bf16-pv"):
        want = arch if htp.native_bf16_attention(native) else "f32"  # type: ignore[arg-type]
        assert resolve_attention("auto", "q8", native, native=arch) == want  # type: ignore[arg-type]
    # an architecture without the evidence (the default), or with it against bf16: fp32
    assert resolve_attention("auto", "q8", native) == "f32"  # type: ignore[arg-type]
    assert resolve_attention("auto", "q8", native, native="f32") == "f32"  # type: ignore[arg-type]
    for bad in ("auto", "fp16", "bf16pv"):
        with pytest.raises(
            ValueError, match=f"ATTENTION_AUTO is bf16, bf16-pv or f32, not '{bad}'"
        ):
            resolve_attention("auto", "q8", native, native=bad)  # type: ignore[arg-type]


def test_each_architecture_states_what_auto_runs() -> None:
    """bf16 for the architectures whose parity rows at 32 prompts show bf16 attention's error
    within 5 % of fp32 attention's (OLMoE, Mixtral, DeepSeek-V2, LFM2-MoE); bf16-pv for
    SmallThinker (two bf16 rows at x1.051 and x1.055, every bf16-pv row within); f32 for
    Qwen3-MoE (x1.050 there) and gpt-oss (its q4_0 row x1.100 with bf16, x1.052 with bf16-pv)."""
    got = {name: mod.ATTENTION_AUTO for name, mod in ARCHITECTURES.items()}
    assert got == {
        "olmoe": "bf16", "llama": "bf16", "deepseek2": "bf16", "lfm2moe": "bf16",
        "qwen3moe": "f32", "gpt-oss": "f32", "smallthinker": "bf16-pv",
    }  # fmt: skip


def test_auto_under_f32_activations_runs_fp32_attention(model: Path) -> None:
    """act f32 keeps fp32 attention (its float64-reference accuracy) whatever the CPU: the
    default's logits are the explicit f32 run's bits and differ from both bf16 modes'."""
    auto, eng_att, res_att = _logits(model, act="f32", attention="auto")
    f32, _, _ = _logits(model, act="f32", attention="f32")
    bf16, _, _ = _logits(model, act="f32", attention="bf16")
    pv, _, _ = _logits(model, act="f32", attention="bf16-pv")
    assert (eng_att, res_att) == ("f32", "f32")
    assert np.array_equal(auto, f32) and not np.array_equal(auto, bf16)
    assert not np.array_equal(auto, pv) and not np.array_equal(pv, bf16)


@pytest.mark.skipif(not NATIVE, reason="this CPU/kernel set multiplies bf16 attention emulated")
def test_auto_under_q8_runs_bf16_attention_where_native(model: Path) -> None:
    """On a native kernel set the q8 auto of an OLMoE model is bf16 attention: reported so, and
    the explicit bf16 run's bits (not fp32's, nor bf16 P·V's)."""
    auto, eng_att, res_att = _logits(model, attention="auto")
    pv, _, _ = _logits(model, attention="bf16-pv")
    bf16, _, _ = _logits(model, attention="bf16")
    f32, _, _ = _logits(model, attention="f32")
    assert (eng_att, res_att) == ("bf16", "bf16")
    assert np.array_equal(auto, bf16) and not np.array_equal(auto, f32)
    assert not np.array_equal(auto, pv)


def test_auto_keeps_fp32_attention_for_qwen3moe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen3-MoE model (ATTENTION_AUTO f32) runs fp32 attention under auto even where bf16
    is native: the explicit f32 run's bits."""
    monkeypatch.setattr(htp, "native_bf16_attention", lambda backend=None: True)
    synth_model("qwen3moe", "tiny", tmp_path / "q.gguf", seed=5)
    pack_model(tmp_path / "q.gguf", tmp_path / "q.estream", progress=False)
    auto, eng_att, res_att = _logits(tmp_path / "q.estream", attention="auto")
    f32, _, _ = _logits(tmp_path / "q.estream", attention="f32")
    assert (eng_att, res_att) == ("f32", "f32")
    assert np.array_equal(auto, f32)


def test_auto_runs_bf16_pv_attention_for_smallthinker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SmallThinker model (ATTENTION_AUTO bf16-pv) runs bf16 P·V attention under auto where
    bf16 is native: reported so, and the explicit bf16-pv run's bits (not fp32's, nor bf16's);
    fp32 where it is not."""
    synth_model("smallthinker", "tiny", tmp_path / "s.gguf", seed=5)
    pack_model(tmp_path / "s.gguf", tmp_path / "s.estream", progress=False)
    m = tmp_path / "s.estream"
    pv, _, _ = _logits(m, attention="bf16-pv")
    bf16, _, _ = _logits(m, attention="bf16")
    f32, _, _ = _logits(m, attention="f32")
    assert not np.array_equal(pv, bf16) and not np.array_equal(pv, f32)
    for native, want, bits in ((True, "bf16-pv", pv), (False, "f32", f32)):
        monkeypatch.setattr(htp, "native_bf16_attention", lambda backend=None, n=native: n)
        auto, eng_att, res_att = _logits(m, attention="auto")
        assert (eng_att, res_att) == (want, want)
        assert np.array_equal(auto, bits)


def test_auto_under_q8_runs_fp32_attention_on_a_kernel_set_without_native_bf16(
    model: Path, simd_avx2: None
) -> None:
    """On AVX2 (bf16 emulated there, slower than fp32) the q8 default is fp32 attention."""
    assert not htp.native_bf16_attention()
    auto, eng_att, res_att = _logits(model, attention="auto")
    f32, _, _ = _logits(model, attention="f32")
    assert (eng_att, res_att) == ("f32", "f32")
    assert np.array_equal(auto, f32)


def test_auto_follows_the_capability_check(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine asks `native_bf16_attention` about the backend running its dense ops (this
    process's default backend for the host), whatever this CPU is."""
    asked: list[object] = []
    for native in (True, False):

        def check(backend: object = None, answer: bool = native) -> bool:
            asked.append(backend)
            return answer

        monkeypatch.setattr(htp, "native_bf16_attention", check)
        with estream.load(model, attention="auto") as eng:
            assert eng.attention == ("bf16" if native else "f32")
        with estream.load(model, act="f32", attention="auto") as eng:
            assert eng.attention == "f32"
        with estream.load(model) as eng:  # the default: auto
            assert eng.attention == ("bf16" if native else "f32")
    assert asked == [htp.default_backend()] * 4


def test_cli_json_reports_the_resolved_attention(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream prefill --json` says which precision ran: auto's resolution, never "auto";
    without --attention, auto's."""
    ids = ",".join(map(str, TOKENS))
    want = {
        ("q8", "auto"): "bf16" if NATIVE else "f32",
        ("q8", "bf16-pv"): "bf16-pv",
        ("f32", "auto"): "f32",
        ("q8",): "bf16" if NATIVE else "f32",
    }
    for (act, *att), ran in want.items():
        extra = ["--attention", *att] if att else []
        assert main(["prefill", str(model), "--tokens", ids, "--json", "--act", act, *extra]) == 0
        assert json.loads(capsys.readouterr().out)["metrics"]["attention"] == ran
    argv = ["prefill", str(model), "--tokens", "1", "--json", "--attention", "bf16", "--act", "f32"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["attention"] == "bf16"
    with pytest.raises(SystemExit) as exit_:
        main(["prefill", str(model), "--tokens", "1", "--attention", "fp16"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'auto', 'f32', 'bf16', 'bf16-pv'" in err


def test_auto_asks_the_executor_when_it_runs_the_dense_ops(model: Path, simd_avx2: None) -> None:
    """With ``dense_ops="backend"`` the executor's kernel set decides (it runs its best level),
    not the host's default backend (AVX2 here, never native): bf16 where the executor's level
    is native."""
    with estream.load(
        model, backend="host-process", dense_ops="backend", attention="auto", n_threads=1
    ) as eng:
        there = htp.native_bf16_attention(eng.backend)
        assert eng.dense_ops == "backend" and not htp.native_bf16_attention()
        assert eng.attention == ("bf16" if there else "f32")
        assert eng.prefill(TOKENS[:9]).metrics["attention"] == eng.attention
    if htp.best_simd_level() in ("avx512", "avx512vnni", "amx"):
        assert there is NATIVE_CPU


def test_auto_with_host_dense_ops_ignores_the_executor(model: Path, simd_avx2: None) -> None:
    """Expert ops in an executor (its best level), dense ops on the host's AVX2 default
    backend: the host decides, f32."""
    with estream.load(model, backend="host-process", dense_ops="host", attention="auto") as eng:
        assert eng.dense_ops == "host" and eng.attention == "f32"
