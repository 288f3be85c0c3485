"""Tasks on text (classify, score, rerank, embed), each checked against an independent
computation from the all-position logits (or hidden states) of plain prefills."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import estream
from estream import tasks
from estream.tokenizer import Tokenizer
from estream.tokenizer.testing import find_vocab_dir
from estream_layout import pack_model, synth_model

TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen3moe with the generated BPE vocabulary (single bytes + ' e', ' t', ' o'...)."""
    d = tmp_path_factory.mktemp("tasks")
    src = d / "m.gguf"
    synth_model("qwen3moe", "tiny", src, seed=11)
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    tok = Tokenizer.from_gguf(dst)
    with estream.load(dst, G=2, Q=2, B=2, act="f32") as eng:
        yield eng, tok


def logsoftmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprobs(eng, ctx: list[int], cont: list[int]) -> np.ndarray:
    """log P of each continuation token, from one separate all-logits prefill of ctx + cont."""
    full = eng.prefill(ctx + cont, all_logits=True).logits
    assert full.shape == (len(ctx) + len(cont), eng.hp.n_vocab)
    lp = logsoftmax(full)
    rows = np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    return lp[rows, np.asarray(cont)]


def one_token_letters(tok) -> list[str]:
    """Letters c whose ' c' is a single token of the vocabulary (the generated vocabulary
    merges a few; which ones depends on the seed)."""
    return [c for c in "abcdefghijklmnopqrstuvwxyz" if len(tok.encode(" " + c)) == 1]


def test_tiny_vocab_has_the_tokens_the_tests_rely_on(tiny):
    _, tok = tiny
    assert len(one_token_letters(tok)) >= 3
    assert len(tok.encode(" yes")) > 1 and tok.encode(" yes")[0] == tok.encode(" no")[0]
    assert not tok.add_bos


# -- classify ----------------------------------------------------------------------------------
def test_classify_single_token_labels_softmax_over_first_tokens(tiny):
    eng, tok = tiny
    prompt = "The weather today is"
    labels = one_token_letters(tok)[:3]
    res = tasks.classify(eng, tok, prompt, labels)
    assert res.method == "first-token"
    ids = tok.encode(prompt, add_special=True)
    last = logsoftmax(eng.prefill(ids, all_logits=True).logits[-1])
    want_ids = [tok.encode(" " + lab) for lab in labels]
    want_lp = np.array([last[i[0]] for i in want_ids])
    want_p = np.exp(want_lp) / np.exp(want_lp).sum()
    assert res.prompt_tokens == len(ids)
    assert [list(s.token_ids) for s in res.labels] == want_ids
    np.testing.assert_allclose([s.logprob for s in res.labels], want_lp, **TOL)
    np.testing.assert_allclose([s.first_token_logprob for s in res.labels], want_lp, **TOL)
    np.testing.assert_allclose([s.prob for s in res.labels], want_p, **TOL)
    assert res.best == labels[int(np.argmax(want_lp))]
    # the sequence method over one branch per label gives the same numbers
    seq = tasks.classify(eng, tok, prompt, labels, method="sequence")
    assert seq.method == "sequence"
    np.testing.assert_allclose([s.prob for s in seq.labels], want_p, **TOL)


def test_classify_multi_token_labels_full_sequence_loglik(tiny):
    eng, tok = tiny
    prompt = "Is this spam? Answer:"
    labels = ["yes", "no", "maybe", "not sure"]
    res = tasks.classify(eng, tok, prompt, labels)
    assert res.method == "sequence"
    ctx = tok.encode(prompt, add_special=True)
    want = []
    for lab, s in zip(labels, res.labels, strict=True):
        cont = tok.encode(" " + lab)
        assert list(s.token_ids) == cont
        lps = token_logprobs(eng, ctx, cont)
        want.append(lps.sum())
        np.testing.assert_allclose(s.first_token_logprob, lps[0], **TOL)
    want = np.array(want)
    np.testing.assert_allclose([s.logprob for s in res.labels], want, **TOL)
    p = np.exp(want - want.max())
    np.testing.assert_allclose([s.prob for s in res.labels], p / p.sum(), **TOL)
    assert res.best == labels[int(np.argmax(want))]


def test_classify_trailing_space_moves_into_the_label(tiny):
    eng, tok = tiny
    a = tasks.classify(eng, tok, "Answer:", ["yes", "no"])
    b = tasks.classify(eng, tok, "Answer: ", ["yes", "no"])
    c = tasks.classify(eng, tok, "Answer:", [" yes", " no"])  # label with its own space
    assert [s.token_ids for s in a.labels] == [s.token_ids for s in b.labels]
    assert [s.token_ids for s in a.labels] == [s.token_ids for s in c.labels]
    np.testing.assert_allclose([s.logprob for s in a.labels], [s.logprob for s in b.labels])


def test_classify_rejects_bad_labels(tiny):
    eng, tok = tiny
    with pytest.raises(estream.BadRequestError, match="no label"):
        tasks.classify(eng, tok, "x", [])
    with pytest.raises(estream.BadRequestError, match="twice"):
        tasks.classify(eng, tok, "x", ["a", "a"])
    with pytest.raises(estream.BadRequestError, match="empty"):
        tasks.classify(eng, tok, "x", ["a", " "])
    with pytest.raises(estream.BadRequestError, match="same token"):  # ' yes' / ' no' share ' '
        tasks.classify(eng, tok, "x", ["yes", "no"], method="first-token")
    with pytest.raises(estream.BadRequestError, match="nothing to predict"):
        tasks.classify(eng, tok, "", ["yes", "no"])  # no BOS in this vocabulary
    with pytest.raises(estream.BadRequestError, match="method"):
        tasks.classify(eng, tok, "x", ["yes"], method="best")


# -- score -------------------------------------------------------------------------------------
CHOICES = ["a cat sat", "the dog", "x", "zebra crossing ahead, slowly", "café au lait"]


def test_score_matches_hand_summed_loglik(tiny):
    eng, tok = tiny
    context = "Question: what is on the mat?\nAnswer:"
    res = tasks.score(eng, tok, context, CHOICES)
    assert res.metrics["passes"] == 1
    ctx = tok.encode(context, add_special=True)
    assert res.context_tokens == len(ctx)
    sums, per_char = [], []
    for text, c in zip(CHOICES, res.choices, strict=True):
        cont = tok.encode(" " + text)
        assert list(c.token_ids) == cont and c.text == text
        lps = token_logprobs(eng, ctx, cont)
        np.testing.assert_allclose(c.logprob, lps.sum(), **TOL)
        np.testing.assert_allclose(c.logprob_per_token, lps.sum() / len(cont), **TOL)
        np.testing.assert_allclose(c.logprob_per_char, lps.sum() / len(text), **TOL)
        np.testing.assert_allclose(c.logprob_per_byte, lps.sum() / len(text.encode()), **TOL)
        full = eng.prefill(ctx + cont, all_logits=True).logits
        greedy = full[len(ctx) - 1 : -1].argmax(axis=1) == np.asarray(cont)
        assert c.greedy == bool(greedy.all())
        sums.append(lps.sum())
        per_char.append(lps.sum() / len(text))
    # "café au lait": 12 characters, 13 bytes
    assert res.choices[4].logprob_per_char != res.choices[4].logprob_per_byte
    assert res.best == int(np.argmax(sums))
    assert res.best_norm == int(np.argmax(per_char))


def test_score_split_into_passes_gives_the_same_answer(tiny):
    eng, tok = tiny
    one = tasks.score(eng, tok, "Once upon a time", CHOICES)
    ctx_len = one.context_tokens
    many = tasks.score(eng, tok, "Once upon a time", CHOICES, max_tokens=ctx_len + 30)
    assert many.metrics["passes"] > 1
    np.testing.assert_allclose(
        [c.logprob for c in many.choices], [c.logprob for c in one.choices], **TOL
    )
    assert (many.best, many.best_norm) == (one.best, one.best_norm)


def test_score_rejects_empty_choices(tiny):
    eng, tok = tiny
    with pytest.raises(estream.BadRequestError, match="no choice"):
        tasks.score(eng, tok, "ctx", [])
    with pytest.raises(estream.BadRequestError, match="choice 2 is empty"):
        tasks.score(eng, tok, "ctx", ["a", ""])


# -- rerank ------------------------------------------------------------------------------------
DOCS = [
    {"id": "d1", "text": "The cat sat on the mat."},
    "Stock prices fell sharply on Monday.",
    {"id": 7, "text": "Cats are small domesticated felines."},
    "e e e",
]


def _doc_text(d):
    return d if isinstance(d, str) else d["text"]


@pytest.mark.parametrize("single", [False, True])
def test_rerank_log_odds_by_hand_and_sorted(tiny, single):
    eng, tok = tiny
    answers = tuple(one_token_letters(tok)[:2]) if single else ("yes", "no")
    query = "Where is the cat?"
    res = tasks.rerank(eng, tok, query, DOCS, answers=answers)
    assert res.metrics["passes"] == 1
    yes_ids, no_ids = tok.encode(" " + answers[0]), tok.encode(" " + answers[1])
    # one pass: the query part once, then each document (with each answer when multi-token)
    doc_tokens = sum(s.doc_tokens for s in res.docs)
    if single:
        assert res.metrics["tokens"] == res.query_tokens + doc_tokens
    else:
        extra = len(DOCS) * (len(yes_ids) + len(no_ids))
        assert res.metrics["tokens"] == res.query_tokens + 2 * doc_tokens + extra
    want = []
    for d in DOCS:
        text = f"Query: {query}\nDocument: {_doc_text(d)}\nRelevant (yes/no):"
        ids = tok.encode(text, add_special=True)
        y = token_logprobs(eng, ids, yes_ids).sum()
        n = token_logprobs(eng, ids, no_ids).sum()
        want.append((y, n))
    by_index = {s.index: s for s in res.docs}
    assert sorted(by_index) == list(range(len(DOCS)))
    for i, (y, n) in enumerate(want):
        s = by_index[i]
        np.testing.assert_allclose([s.logprob_yes, s.logprob_no, s.score], [y, n, y - n], **TOL)
    assert [s.id for s in res.docs if s.index == 0] == ["d1"]
    assert [s.id for s in res.docs if s.index == 1] == [1]  # no id: the position
    assert [s.id for s in res.docs if s.index == 2] == [7]
    scores = [s.score for s in res.docs]
    assert scores == sorted(scores, reverse=True)
    assert [s.index for s in res.docs] == list(np.argsort([-(y - n) for y, n in want]))


def test_rerank_rejects_bad_docs(tiny):
    eng, tok = tiny
    with pytest.raises(estream.BadRequestError, match="no documents"):
        tasks.rerank(eng, tok, "q", [])
    with pytest.raises(estream.BadRequestError, match="document 2"):
        tasks.rerank(eng, tok, "q", ["fine", {"id": 3}])
    with pytest.raises(estream.BadRequestError, match="answers"):
        tasks.rerank(eng, tok, "q", ["fine"], answers=("yes", "yes"))


# -- embed -------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["last", "mean"])
@pytest.mark.parametrize("normalize", [False, True])
def test_embed_equals_pooled_hidden_state(tiny, pool, normalize):
    eng, tok = tiny
    prompt = "An embedding of this sentence, please."
    res = tasks.embed(eng, tok, prompt, pool=pool, normalize=normalize)
    ids = tok.encode(prompt, add_special=True)
    h = eng.prefill(ids, all_logits=True, return_hidden=True).hidden.astype(np.float64)
    assert h.shape == (len(ids), eng.hp.n_embd)
    v = h[-1] if pool == "last" else h.mean(axis=0)
    if normalize:
        v = v / np.linalg.norm(v)
        np.testing.assert_allclose(np.linalg.norm(res.embedding), 1.0, rtol=1e-5)
    assert res.embedding.shape == (eng.hp.n_embd,) and res.tokens == len(ids)
    np.testing.assert_allclose(res.embedding, v, rtol=1e-4, atol=1e-5)
    with pytest.raises(estream.BadRequestError, match="pool"):
        tasks.embed(eng, tok, prompt, pool="max")


# -- real vocabularies -------------------------------------------------------------------------
def _vocab(name: str):
    d = find_vocab_dir()
    if not (d / f"ggml-vocab-{name}.gguf").is_file():
        pytest.fail(f"ggml-vocab-{name}.gguf not found in {d} (estream-layout's package data)")
    return d / f"ggml-vocab-{name}.gguf"


@pytest.fixture(scope="module", params=["qwen2", "llama-spm"])
def real(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    src = d / "m.gguf"
    synth_model("qwen3moe", "tiny", src, seed=2, vocab=_vocab(request.param))
    dst = d / "m.estream"
    pack_model(src, dst, progress=False)
    tok = Tokenizer.from_gguf(dst)
    with estream.load(dst, G=2, Q=2, B=2, act="f32") as eng:
        yield eng, tok


def test_real_vocab_labels_are_single_word_tokens(real):
    """' yes' / ' no' are one token each in real vocabularies: the first-token path is taken,
    with the word-with-leading-space token (BPE 'Ġyes', SentencePiece '▁yes')."""
    eng, tok = real
    prompt = "Is the sky blue? Answer:"
    res = tasks.classify(eng, tok, prompt, ["yes", "no"])
    assert res.method == "first-token"
    ids = tok.encode(prompt, add_special=True)
    want_ids = []
    for lab in ("yes", "no"):
        whole = tok.encode(prompt + " " + lab)
        assert whole[: len(whole) - 1] == tok.encode(prompt)
        want_ids.append(whole[-1])
        assert tok.decode([whole[-1]]).strip() == lab
    assert [s.token_ids for s in res.labels] == [(want_ids[0],), (want_ids[1],)]
    last = logsoftmax(eng.prefill(ids, all_logits=True).logits[-1])
    np.testing.assert_allclose(
        [s.logprob for s in res.labels], [last[want_ids[0]], last[want_ids[1]]], **TOL
    )
    # a trailing space in the prompt is moved into the label: same tokens, same answer
    spaced = tasks.classify(eng, tok, prompt + " ", ["yes", "no"])
    assert [s.token_ids for s in spaced.labels] == [s.token_ids for s in res.labels]
    assert spaced.prompt_tokens == res.prompt_tokens


def test_real_vocab_rerank_single_token_answers(real):
    eng, tok = real
    res = tasks.rerank(eng, tok, "cats", ["A cat.", "Bonds and stocks."])
    ans = [tok.encode("Relevant (yes/no): " + a)[-1] for a in ("yes", "no")]
    for s in res.docs:
        text = f"Query: cats\nDocument: {['A cat.', 'Bonds and stocks.'][s.index]}"
        ids = tok.encode(text + "\nRelevant (yes/no):", add_special=True)
        last = logsoftmax(eng.prefill(ids, all_logits=True).logits[-1])
        np.testing.assert_allclose(
            [s.logprob_yes, s.logprob_no], [last[ans[0]], last[ans[1]]], **TOL
        )


# -- properties --------------------------------------------------------------------------------
WORDS = ["yes", "no", "maybe", "a b", "zz", "x", "tea", "coffee"]


@settings(max_examples=25)
@given(data=st.data())
def test_classify_is_invariant_to_label_order(tiny, data):
    """Probabilities sum to 1 and follow their labels under any permutation and subset."""
    eng, tok = tiny
    pool = WORDS + one_token_letters(tok)[:4]
    labels = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5, unique=True))
    perm = data.draw(st.permutations(labels))
    prompt = data.draw(st.sampled_from(["Answer:", "Answer: ", "Choose one of them"]))
    a = tasks.classify(eng, tok, prompt, labels)
    b = tasks.classify(eng, tok, prompt, perm)
    assert abs(sum(s.prob for s in a.labels) - 1.0) < 1e-9
    pa = {s.label: s.logprob for s in a.labels}
    pb = {s.label: s.logprob for s in b.labels}
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], **TOL)
    if len(labels) == len({round(v, 3) for v in pa.values()}):  # no near-ties
        assert a.best == b.best


@settings(max_examples=15)
@given(max_tokens=st.integers(1, 60))
def test_score_any_pass_split_gives_the_same_answer(tiny, max_tokens):
    eng, tok = tiny
    one = tasks.score(eng, tok, "Once upon a time", CHOICES)
    split = tasks.score(eng, tok, "Once upon a time", CHOICES, max_tokens=max_tokens)
    np.testing.assert_allclose(
        [c.logprob for c in split.choices], [c.logprob for c in one.choices], **TOL
    )
    assert [c.greedy for c in split.choices] == [c.greedy for c in one.choices]
