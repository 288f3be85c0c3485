"""Shared-prefix scoring: one pass over a prefix and many continuations equals separate passes."""

from __future__ import annotations

import numpy as np
import pytest

import estream
from estream_layout import pack_model, synth_model


# lfm2moe: its short convolutions must continue the prefix in each branch, not run over the
# packed order (where a branch follows the previous branch's tokens). gpt-oss: its sliding
# window (8 tokens on tiny, shorter than prefix + branch) and sinks in a continuing segment.
@pytest.fixture(scope="module", params=["qwen3moe", "mixtral", "lfm2moe", "gpt-oss"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("br")
    src = d / "m.gguf"
    synth_model(request.param, "tiny", src, seed=5)
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    return dst


def _logsoftmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("n_prefix", [1, 11])  # 1: shorter than a short convolution's history
@pytest.mark.parametrize("act", ["f32", "q8"])
def test_branches_equal_separate_prefills(model, act, n_prefix):
    rng = np.random.default_rng(0)
    with estream.load(model, G=2, Q=2, B=2, act=act) as eng:
        V = eng.hp.n_vocab
        prefix = rng.integers(0, V, n_prefix)
        branches = [rng.integers(0, V, n) for n in (1, 4, 7)]
        res = eng.prefill_branches(prefix, branches, return_hidden=True)
        lps = res.continuation_logprobs(branches)
        for i, br in enumerate(branches):
            full = eng.prefill(np.concatenate([prefix, br]), all_logits=True).logits
            got = np.vstack([res.prefix_logits[None], res.branch_logits[i]])
            want = full[len(prefix) - 1 :]
            # f32: the same arithmetic up to summation order. q8: the branch attention (BLAS)
            # and the tiled kernel differ in the last bits, and int8 rounding of the next
            # projection's input is discontinuous, so an occasional flipped rounding (1/254 of a
            # block's range) propagates: measured ~1e-3 on the chaotic tiny models.
            tol, lp_tol = (1e-5, 1e-4) if act == "f32" else (1e-2, 5e-2)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) <= tol
            # the log-likelihood summed by hand from the separate pass
            lp = _logsoftmax(full[len(prefix) - 1 : -1])[np.arange(len(br)), br]
            np.testing.assert_allclose(lps[i], lp, rtol=lp_tol, atol=lp_tol)
    assert res.hidden is not None and res.hidden.shape[0] == len(prefix) + sum(map(len, branches))


def test_branches_reject_bad_input(model):
    with estream.load(model, G=2, Q=2, B=2) as eng, pytest.raises(estream.BadRequestError):
        eng.prefill_branches([1, 2], [])
    with estream.load(model, G=2, Q=2, B=2) as eng, pytest.raises(estream.BadRequestError):
        eng.prefill_branches([1, 2], [[eng.hp.n_vocab]])


@pytest.mark.parametrize("attention", ["bf16", "bf16-pv"])
def test_branches_round_attention_as_the_kernel_does(model, attention):
    """A branch's attention over the prefix (BLAS, outside the tiled kernel) applies the
    kernel's bf16 roundings of the mode (bf16: q·scale, k, v and the weights; bf16-pv: v and
    the weights only): the branch logits sit far closer to a separate prefill with the same
    attention than that prefill sits to fp32 attention's. fp32 activations, so attention is the
    only rounding in play."""
    rng = np.random.default_rng(1)
    with estream.load(model, G=2, Q=2, B=2, act="f32", attention=attention) as eng:
        V = eng.hp.n_vocab
        prefix, branches = rng.integers(0, V, 11), [rng.integers(0, V, n) for n in (5, 9)]
        res = eng.prefill_branches(prefix, branches)
        fulls = [eng.prefill(np.concatenate([prefix, b]), all_logits=True).logits for b in branches]
    with estream.load(model, G=2, Q=2, B=2, act="f32", attention="f32") as eng:
        f32 = [eng.prefill(np.concatenate([prefix, b]), all_logits=True).logits for b in branches]
    for i, full in enumerate(fulls):
        want = full[len(prefix) :]
        off_mode = np.linalg.norm(res.branch_logits[i] - want) / np.linalg.norm(want)
        mode_vs_f32 = np.linalg.norm(want - f32[i][len(prefix) :]) / np.linalg.norm(want)
        assert mode_vs_f32 > 1e-5  # the mode really rounds
        assert off_mode < mode_vs_f32 / 10, (off_mode, mode_vs_f32)
