"""Many requests in one pass: `Engine.prefill_batch` equals separate passes, `prefill_many`
forms passes from a token budget and survives a failing pass, the engine stays usable."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import estream
from estream import BranchRequest
from estream.engine import pass_bytes_per_token
from estream_layout import pack_model, synth_model

ARCHS = ["olmoe", "qwen3moe", "mixtral", "deepseek2", "lfm2moe", "smallthinker", "gpt-oss"]
MODES = {"stream": {"G": 2, "Q": 2, "B": 2}, "resident": {}, "naive": {}, "layer": {}}
# Every kernel computes a row on its own and BLAS products run per request, so a request's
# numbers do not depend on its batch: measured bit-identical. The contract is 1e-5 relative.
RTOL = 1e-5


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    synth_model(request.param, "tiny", d / "m.gguf", seed=7)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


def _requests(V: int, rng: np.random.Generator) -> list:
    """Plain requests of awkward lengths (1: shorter than a short convolution's history), two
    identical ones, and branch requests with a 1-token and an 11-token prefix."""
    same = rng.integers(0, V, 9)
    return [
        rng.integers(0, V, 1),
        rng.integers(0, V, 5),
        BranchRequest(rng.integers(0, V, 11), [rng.integers(0, V, n) for n in (1, 4, 7)]),
        same,
        rng.integers(0, V, 17),
        same.copy(),
        BranchRequest(rng.integers(0, V, 1), [rng.integers(0, V, n) for n in (3, 2)]),
        rng.integers(0, V, 2),
    ]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _alone(eng, req, *, all_logits=True):
    if isinstance(req, BranchRequest):
        r = eng.prefill_branches(req.prefix, req.branches, return_hidden=True)
        return [r.prefix_logits, *r.branch_logits], r.hidden
    r = eng.prefill(req, all_logits=all_logits, return_hidden=True)
    return [r.logits], r.hidden


def _got(res):
    if isinstance(res, estream.BranchResult):
        return [res.prefix_logits, *res.branch_logits], res.hidden
    return [res.logits], res.hidden


@pytest.mark.parametrize("act", ["q8", "f32"])
@pytest.mark.parametrize("mode", list(MODES))
def test_batch_equals_separate_passes(model, mode, act):
    rng = np.random.default_rng(3)
    with estream.load(model, mode=mode, act=act, **MODES[mode]) as eng:
        reqs = _requests(eng.hp.n_vocab, rng)
        for all_logits in (True, False):
            results = eng.prefill_batch(reqs, all_logits=all_logits, return_hidden=True)
            assert len(results) == len(reqs)
            for req, res in zip(reqs, results, strict=True):
                want_l, want_h = _alone(eng, req, all_logits=all_logits)
                got_l, got_h = _got(res)
                assert len(got_l) == len(want_l)
                for g, w in zip(got_l, want_l, strict=True):
                    assert g.shape == w.shape
                    assert _rel(g, w) <= RTOL
                assert got_h.shape == want_h.shape and _rel(got_h, want_h) <= RTOL
        # the per-request and per-pass metrics
        sizes = [_tokens(r) for r in reqs]
        for i, (n, res) in enumerate(zip(sizes, results, strict=True)):
            m = res.metrics
            assert m["index"] == i and m["tokens"] == n
            assert m["pass"] is results[0].metrics["pass"]
        p = results[0].metrics["pass"]
        assert p["requests"] == len(reqs) and p["tokens"] == sum(sizes)
        if mode != "resident":  # every expert group is read at most once for the whole pass
            experts = sum(lay.n_experts * lay.record_bytes for lay in eng.model.layers.values())
            assert 0 < p["bytes_read"] <= experts
            plain = [r for r in reqs if not isinstance(r, BranchRequest)]
            alone = sum(eng.prefill(r).metrics["bytes_read"] for r in plain)
            assert p["bytes_read"] < alone


def _tokens(req) -> int:
    if isinstance(req, BranchRequest):
        return len(req.prefix) + sum(map(len, req.branches))
    return len(req)


def test_batch_of_one_equals_prefill_and_rejects_bad_input(model):
    rng = np.random.default_rng(1)
    with estream.load(model, **MODES["stream"]) as eng:
        V = eng.hp.n_vocab
        toks = rng.integers(0, V, 6)
        (one,) = eng.prefill_batch([toks])
        assert one.logits.shape == (V,)
        np.testing.assert_array_equal(one.logits, eng.prefill(toks).logits)
        for bad in ([], [[V]], [[1, 2], []], [BranchRequest([1], [])], "abc"):
            with pytest.raises(estream.BadRequestError):
                eng.prefill_batch(bad)
        # the engine still works after the refusals
        np.testing.assert_array_equal(eng.prefill_batch([toks])[0].logits, one.logits)


def _pass_of(res) -> int:
    return res.metrics["pass"]["pass_id"]


def test_prefill_many_splits_by_the_token_budget(model):
    rng = np.random.default_rng(2)
    with estream.load(model, **MODES["stream"]) as eng:
        V = eng.hp.n_vocab
        lens = [3, 4, 5, 20, 2, 2, 9]
        reqs = [rng.integers(0, V, n) for n in lens]
        out = list(eng.prefill_many(reqs, batch_tokens=10, all_logits=True))
        # arrival order: [3, 4] (7; +5 > 10), [5] (+20 > 10), [20] alone (longer than the
        # budget), [2, 2] (4; +9 > 10), [9]
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(out):
            groups.setdefault(_pass_of(r), []).append(i)
        assert list(groups.values()) == [[0, 1], [2], [3], [4, 5], [6]]
        for req, res in zip(reqs, out, strict=True):
            assert _rel(res.logits, eng.prefill(req, all_logits=True).logits) <= RTOL
        # one pass when everything fits; a branch request counts all its tokens
        br = BranchRequest(rng.integers(0, V, 4), [rng.integers(0, V, 3)])
        out = list(eng.prefill_many([*reqs[:2], br], batch_tokens=14))
        assert len({_pass_of(r) for r in out}) == 1
        out = list(eng.prefill_many([*reqs[:2], br], batch_tokens=13))
        assert [_pass_of(r) for r in out][1:] != [_pass_of(out[0])] * 2
        with pytest.raises(estream.BadRequestError):
            list(eng.prefill_many(reqs, batch_tokens=0))


def test_prefill_many_default_budget_formula(model):
    with estream.load(model, **MODES["stream"]) as eng:
        hp = eng.hp
        per = pass_bytes_per_token(hp)
        assert pass_bytes_per_token(hp, all_logits=True) == per + 4 * hp.n_vocab
        n = eng.default_batch_tokens()
        assert n == max(64, min(8192, estream_cli_default() // per))
        assert eng.default_batch_tokens(all_logits=True) <= n


def estream_cli_default() -> int:
    from estream.engine import DEFAULT_ACTIVATION_BYTES

    return DEFAULT_ACTIVATION_BYTES


def test_prefill_many_bad_request_gets_its_own_error(model):
    rng = np.random.default_rng(4)
    with estream.load(model, **MODES["stream"]) as eng:
        V = eng.hp.n_vocab
        reqs = [rng.integers(0, V, 4), [V + 3], rng.integers(0, V, 6)]
        out = list(eng.prefill_many(reqs, return_exceptions=True))
        assert isinstance(out[1], estream.BadRequestError)
        for i in (0, 2):
            assert _rel(out[i].logits, eng.prefill(reqs[i]).logits) <= RTOL
        assert _pass_of(out[0]) == _pass_of(out[2])  # the bad one did not split the pass
        # without return_exceptions the earlier results come out, then the error is raised
        it = eng.prefill_many(reqs)
        first = next(it)
        assert _rel(first.logits, out[0].logits) <= RTOL
        with pytest.raises(estream.BadRequestError):
            next(it)


class _Boom(OSError):
    pass


def _failing(eng, monkeypatch, should_fail, exc=_Boom):
    """Make the expert source raise in the middle of a pass (a read error) when
    ``should_fail(rows of the pass)``; count the recoveries."""
    real_run, real_recover = eng.experts.run_layer, eng.experts.recover
    seen = {"recover": 0}

    def run_layer(layer, x, ids, weights, y):
        if should_fail(x.shape[0]) and layer.index > 0:
            raise exc("injected failure in the middle of a pass")
        return real_run(layer, x, ids, weights, y)

    def recover():
        seen["recover"] += 1
        return real_recover()

    monkeypatch.setattr(eng.experts, "run_layer", run_layer)
    monkeypatch.setattr(eng.experts, "recover", recover)
    return seen


@pytest.mark.parametrize("mode", ["stream", "resident"])
def test_failed_pass_is_rerun_request_by_request(model, mode, monkeypatch):
    rng = np.random.default_rng(5)
    with estream.load(model, mode=mode, **MODES[mode]) as eng:
        V = eng.hp.n_vocab
        reqs = [rng.integers(0, V, n) for n in (3, 7, 5)]
        want = [eng.prefill(r).logits for r in reqs]
        # the batched pass fails, each request alone works: every result is there
        seen = _failing(eng, monkeypatch, lambda rows: rows == 15)
        out = list(eng.prefill_many(reqs, return_exceptions=True))
        assert seen["recover"] == 1
        assert [_pass_of(r) for r in out] == sorted({_pass_of(r) for r in out})  # 3 passes
        for got, w in zip(out, want, strict=True):
            assert _rel(got.logits, w) <= RTOL
        monkeypatch.undo()
        # the request of 7 tokens fails alone too: only its slot holds the error
        seen = _failing(eng, monkeypatch, lambda rows: rows in (15, 7))
        out = list(eng.prefill_many(reqs, return_exceptions=True))
        assert isinstance(out[1], _Boom) and seen["recover"] == 2
        assert _rel(out[0].logits, want[0]) <= RTOL and _rel(out[2].logits, want[2]) <= RTOL
        monkeypatch.undo()
        # and the engine works afterwards
        for got, w in zip(eng.prefill_batch(reqs), want, strict=True):
            assert _rel(got.logits, w) <= RTOL


def test_ctrl_c_mid_pass_is_not_retried_and_leaves_the_engine_usable(model, monkeypatch):
    rng = np.random.default_rng(6)
    with estream.load(model, **MODES["stream"]) as eng:
        V = eng.hp.n_vocab
        reqs = [rng.integers(0, V, n) for n in (4, 6)]
        want = [eng.prefill(r).logits for r in reqs]
        threads = threading.active_count()
        seen = _failing(eng, monkeypatch, lambda rows: True, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            list(eng.prefill_many(reqs))
        assert seen["recover"] == 1  # once: the pass was not re-run request by request
        with pytest.raises(KeyboardInterrupt):
            eng.prefill_batch(reqs)
        monkeypatch.undo()
        assert threading.active_count() <= threads
        for got, w in zip(eng.prefill_batch(reqs), want, strict=True):
            assert _rel(got.logits, w) <= RTOL
