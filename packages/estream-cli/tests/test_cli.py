"""The `estream` command: outputs, files it writes, and the errors a user can hit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from estream_cli.main import main
from estream_layout import pack_model, synth_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    src = d / "m.gguf"
    synth_model("olmoe", "tiny", src, seed=3)
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    return dst


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_prefill_json_reports_topk_and_metrics(model, capsys):
    rc, out, _ = run(capsys, "prefill", str(model), "--tokens", "1,2,3,4,5", "--json", "-G", "2")
    assert rc == 0
    doc = json.loads(out)
    assert len(doc["top_k"]) == 5
    probs = [t["prob"] for t in doc["top_k"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-6
    m = doc["metrics"]
    for key in ("ttft_s", "peak_memory_bytes", "bytes_read", "io_compute_overlap", "bubble_rate"):
        assert key in m
    assert m["tokens"] == 5 and m["G"] == 2


def test_all_logits_and_trace_files(model, capsys, tmp_path):
    npy = tmp_path / "logits.npy"
    trace = tmp_path / "trace.json"
    rc, out, _ = run(
        capsys,
        "prefill",
        str(model),
        "--tokens",
        "7,8,9",
        "--all-logits",
        str(npy),
        "--trace",
        str(trace),
        "--top-k",
        "3",
    )
    assert rc == 0
    logits = np.load(npy)
    assert logits.dtype == np.float32 and logits.shape[0] == 3
    top = int(out.split("\n")[1].split()[0])
    assert top == int(np.argmax(logits[-1]))
    doc = json.loads(trace.read_text())
    names = {e["name"] for e in doc["traceEvents"]}
    assert any(n.startswith("read L") for n in names)
    assert any(n.startswith("experts L") for n in names)
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize(
    ("argv", "needle", "code"),
    [
        (["--tokens", "1,999999"], "out of the vocabulary", 2),
        (["--tokens", "1,x"], "integer ids", 2),
        (["--tokens", "1", "--mode", "resident", "--budget", "1KiB"], "does nothing", 2),
        (["--tokens", "1", "--budget", "lots"], "cannot read memory size", 2),
        (["--tokens", "1", "--budget", "1KiB"], "no profile stored", 1),
    ],
)
def test_bad_requests(model, capsys, argv, needle, code):
    rc, _, err = run(capsys, "prefill", str(model), *argv)
    assert rc == code
    assert needle in err
    assert "Traceback" not in err


def test_resident_without_the_memory_for_its_experts(model, capsys, monkeypatch):
    """`resident` where the expert pool cannot be mapped: one line naming the size and the way
    out (stream), exit 1, no traceback."""
    from estream import packed

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(packed.ea, "private_mapping", refuse)
    rc, _, err = run(capsys, "prefill", str(model), "--tokens", "1", "--mode", "resident")
    assert rc == 1
    assert "resident mode holds every expert in memory" in err and "--mode stream" in err
    assert "experts.bin: cannot allocate" in err
    assert "Traceback" not in err


def test_prompt_longer_than_context(model, capsys):
    from estream.packed import PackedModel

    n_ctx = PackedModel(model).hparams.n_ctx
    toks = ",".join(["1"] * (n_ctx + 1))
    rc, _, err = run(capsys, "prefill", str(model), "--tokens", toks)
    assert rc == 2 and "longer than the model context" in err


def test_missing_and_corrupt_pack(model, capsys, tmp_path):
    rc, _, err = run(capsys, "prefill", str(tmp_path / "nope.estream"), "--tokens", "1")
    assert rc == 1 and "no such packed model" in err
    bad = tmp_path / "bad.estream"
    shutil.copytree(model, bad)
    (bad / "manifest.json").unlink()
    rc, _, err = run(capsys, "prefill", str(bad), "--tokens", "1")
    assert rc == 1 and "manifest.json is missing" in err
    bad2 = tmp_path / "bad2.estream"
    shutil.copytree(model, bad2)
    with open(bad2 / "experts.bin", "r+b") as f:
        f.truncate(4096)
    rc, _, err = run(capsys, "prefill", str(bad2), "--tokens", "1")
    assert rc == 1 and "corrupt" in err


def test_profile_config_then_budget(model, capsys, tmp_path):
    m = tmp_path / "p.estream"
    shutil.copytree(model, m)
    rc, _, _ = run(
        capsys,
        "profile",
        str(m),
        "--candidates",
        "1,2,4",
        "--queue-depths",
        "1,2",
        "--tokens",
        "16",
        "--bw-rounds",
        "2",
    )
    assert rc == 0
    man = json.loads((m / "manifest.json").read_text())
    assert man["profile"] is not None and man["config"] is None
    prof = man["profile"]
    assert prof["meta"]["bandwidth_rounds"] == 2
    for g in ("1", "2", "4"):
        for q in ("1", "2"):
            got = prof["meta"]["bandwidth_samples"][g][q]
            assert len(got) == 2 and all(x > 0 for x in got)
            assert prof["bandwidth"][g][q] == pytest.approx(sum(got) / 2, rel=1e-12)
    rc, _, err = run(capsys, "config", str(m), "--budget", "1KiB")
    assert rc == 1 and "below the minimum" in err
    rc, out, _ = run(capsys, "config", str(m), "--budget", "4GiB", "--json")
    assert rc == 0
    cfg = json.loads(out)["config"]
    man = json.loads((m / "manifest.json").read_text())
    assert man["config"]["G"] == cfg["G"] and cfg["memory_bytes"] <= 4 << 30
    rc, out, _ = run(capsys, "prefill", str(m), "--tokens", "1,2,3", "--json")
    assert rc == 0
    got = json.loads(out)["metrics"]
    assert (got["G"], got["Q"], got["B"]) == (cfg["G"], cfg["Q"], cfg["B"])
    assert got["config_source"] == "manifest"
    # for another prompt length: the profile's times scaled to it (estream_sched.configure)
    import estream_sched as es

    profile = es.Profile.from_dict(man["profile"])
    want = es.configure(profile, 4 << 30, tokens=128)
    rc, out, _ = run(capsys, "config", str(m), "--budget", "4GiB", "--tokens", "128", "--json")
    assert rc == 0
    cfg128 = json.loads(out)["config"]
    assert (cfg128["G"], cfg128["Q"], cfg128["B"]) == (want.G, want.Q, want.B)
    assert cfg128["predicted_s"] == pytest.approx(want.predicted_s, rel=1e-12)
    assert want.predicted_s > es.configure(profile, 4 << 30).predicted_s  # 8x the tokens
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "config", str(m), "--budget", "4GiB", "--tokens", "0")
    assert exit_.value.code == 2 and "--tokens: must be >= 1" in capsys.readouterr().err
    # prefill --budget configures for the request's own length
    ids = ",".join(str(i % 50 + 1) for i in range(40))
    rc, out, _ = run(capsys, "prefill", str(m), "--tokens", ids, "--budget", "4GiB", "--json")
    assert rc == 0
    got = json.loads(out)["metrics"]
    want40 = es.configure(profile, 4 << 30, tokens=40)
    assert (got["G"], got["Q"], got["B"]) == (want40.G, want40.Q, want40.B)
    assert got["config_source"] == "budget"
    from estream import load
    from estream.errors import BadRequestError

    for bad in (0, True, 2.5):
        with pytest.raises(BadRequestError, match="budget_tokens must be an int >= 1"):
            load(m, budget="4GiB", budget_tokens=bad)


def test_bandwidth_rounds_interleave_and_keep_the_median():
    from estream.profiling import measure_bandwidth_table

    order: list[tuple[int, int]] = []

    def fake(_model, g, q):
        order.append((g, q))
        # the i-th call returns i: a point's samples are its positions in the visiting order
        return float(len(order))

    med, samples = measure_bandwidth_table(None, [1, 4], [1, 2], rounds=3, measure=fake)
    pts = [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert order == pts + pts[1:] + pts[:1] + pts[2:] + pts[:2]
    assert samples[1][1] == [1.0, 8.0, 11.0] and med[1][1] == 8.0
    assert samples[4][2] == [4.0, 7.0, 10.0] and med[4][2] == 7.0
    assert set(med) == {1, 4} and all(set(v) == {1, 2} for v in med.values())
    with pytest.raises(ValueError, match="rounds"):
        measure_bandwidth_table(None, [1], [1], rounds=0, measure=fake)


def test_engine_releases_threads_on_error(model):
    import estream

    before = threading.active_count()
    with pytest.raises(estream.BadRequestError), estream.load(model, G=1, Q=2, B=2) as eng:
        eng.prefill([10**9])
    assert threading.active_count() <= before


def test_console_script_exit_code(model):
    proc = subprocess.run(
        [sys.executable, "-m", "estream_cli.main", "prefill", str(model), "--tokens", "-1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "out of the vocabulary" in proc.stderr


# -- estream synth | pack: everything goes through to estream-layout's own commands ----------
def _estream(*argv: str, cwd=None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "estream_cli.main", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)


def _layout(tool: str, *argv: str, cwd=None) -> subprocess.CompletedProcess[str]:
    code = f"import sys; from estream_layout.cli import {tool}_main as m; sys.exit(m(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("tool", ["synth", "pack"])
def test_pass_through_help_is_the_layout_commands_help(tool):
    ours, theirs = _estream(tool, "--help"), _layout(tool, "--help")
    assert ours.returncode == theirs.returncode == 0
    assert ours.stdout == theirs.stdout and f"estream-{tool}" in ours.stdout


def test_pass_through_options_first_reach_estream_synth_and_pack(tmp_path):
    """The README's `estream synth --arch ... -o ...` (options before any positional: argparse's
    REMAINDER used to drop them with "unrecognized arguments: --arch")."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    p = _estream("synth", "--arch", "qwen3moe", "--preset", "tiny", "--seed", "5", "-o", str(a))
    assert p.returncode == 0, p.stderr
    q = _layout("synth", "--arch", "qwen3moe", "--preset", "tiny", "--seed", "5", "-o", str(b))
    assert q.returncode == 0, q.stderr
    assert a.read_bytes() == b.read_bytes()
    p = _estream("pack", "--no-progress", str(a), "-o", str(tmp_path / "a.estream"))
    assert p.returncode == 0, p.stderr
    p = _estream("pack", "--verify", str(tmp_path / "a.estream"), "--against", str(a))
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize(
    "argv",
    [["synth", "--arch", "nope", "-o", "x.gguf"], ["pack", "--bogus"], ["pack"]],
)
def test_pass_through_usage_errors_are_the_layout_commands_errors(argv, tmp_path):
    ours = _estream(*argv, cwd=tmp_path)
    theirs = _layout(argv[0], *argv[1:], cwd=tmp_path)
    assert ours.returncode == theirs.returncode != 0
    assert ours.stderr == theirs.stderr and f"estream-{argv[0]}" in ours.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_synth_refuses_a_preset_of_another_architecture(tmp_path, capsys):
    """`estream synth --arch ...` (an option first) reaches estream-synth, as documented."""
    src = tmp_path / "m.gguf"
    argv = ["synth", "--arch", "mixtral", "--preset", "tiny", "--no-progress", "-o", str(src)]
    assert main(argv) == 0
    assert src.is_file() and "wrote" in capsys.readouterr().out
    assert main(["pack", "--no-progress", str(src), "-o", str(tmp_path / "m.estream")]) == 0
    assert (tmp_path / "m.estream" / "manifest.json").is_file()
    assert main(["synth", "--arch", "olmoe", "--preset", "mixtral-8x7b", "-o", str(src)]) == 2
    assert "use --arch mixtral" in capsys.readouterr().err


def test_attention_products_under_f32_activations_are_fp32_unless_bf16_is_asked_for(
    model, capsys, tmp_path
):
    """`--attention` chooses the attention kernel's products: with --act f32 the default (auto)
    is fp32 (the float64-reference accuracy that path is held to); bf16 changes the logits a
    little, not a lot."""

    def logits(*extra: str) -> tuple[np.ndarray, dict]:
        npy = tmp_path / "l.npy"
        rc, out, _ = run(
            capsys, "prefill", str(model), "--tokens", ",".join(map(str, range(3, 90))),
            "--all-logits", str(npy), "--json", "--act", "f32", *extra,
        )  # fmt: skip
        assert rc == 0
        return np.load(npy).astype(np.float64), json.loads(out)["metrics"]

    default, m0 = logits()
    fp32, m1 = logits("--attention", "f32")
    bf16, m2 = logits("--attention", "bf16")
    assert (m0["attention"], m1["attention"], m2["attention"]) == ("f32", "f32", "bf16")
    assert np.array_equal(default, fp32)
    err = np.linalg.norm(bf16 - fp32) / np.linalg.norm(fp32)
    assert 0 < err < 2e-2, err
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "prefill", str(model), "--tokens", "1", "--attention", "f16")
    assert exit_.value.code == 2 and "--attention" in capsys.readouterr().err
    import estream

    with pytest.raises(
        estream.BadRequestError, match="attention must be one of auto, f32, bf16, bf16-pv"
    ):
        estream.load(model, attention="fp8")
