"""The task commands: JSON Lines batches, single requests, errors a user can hit, and the
``--template`` option on models with and without a chat template."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import estream
from estream import tasks
from estream.template import ChatTemplate, NoChatTemplateError, TemplateRenderError
from estream.tokenizer import Tokenizer
from estream_cli.main import main
from estream_layout import pack_model, synth_model

TOL = {"rtol": 1e-4, "atol": 1e-4}
ENGINE = ("-G", "2", "-Q", "2", "-B", "2", "--act", "f32")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def with_chat_template(src, dst, template: str) -> None:
    """Copy GGUF `src` to `dst` (every key and tensor) and add tokenizer.chat_template."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    w.add_string("tokenizer.chat_template", template)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["qwen3moe", "lfm2moe", "gpt-oss"])
def models(tmp_path_factory, request):
    """(plain model, the same model with a chat template); lfm2moe: the task commands over a
    short-convolution hybrid (classify/score/rerank use shared-prefix branches); gpt-oss: over
    a sliding window (8 tokens on tiny) and attention sinks."""
    d = tmp_path_factory.mktemp("taskcli")
    src = d / "m.gguf"
    synth_model(request.param, "tiny", src, seed=4)
    plain = d / "m.estream"
    pack_model(src, plain, progress=False)
    tsrc = d / "t.gguf"
    with_chat_template(src, tsrc, TEMPLATE)
    templated = d / "t.estream"
    pack_model(tsrc, templated, progress=False)
    return plain, templated


@pytest.fixture(scope="module")
def api(models):
    plain, _ = models
    tok = Tokenizer.from_gguf(plain)
    with estream.load(plain, G=2, Q=2, B=2, act="f32") as eng:
        yield eng, tok


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def logsoftmax(z):
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# -- single requests ---------------------------------------------------------------------------
def test_classify_json_equals_the_api(models, api, capsys):
    eng, tok = api
    rc, out, _ = run(
        capsys, "classify", models[0], "--prompt", "Spam?", "--labels", "yes, no,maybe", "--json",
        *ENGINE,
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out)
    want = tasks.classify(eng, tok, "Spam?", ["yes", "no", "maybe"])
    assert [s["label"] for s in doc["labels"]] == ["yes", "no", "maybe"]
    np.testing.assert_allclose([s["prob"] for s in doc["labels"]], [s.prob for s in want.labels])
    assert doc["best"] == want.best and doc["method"] == "sequence"
    assert doc["metrics"]["passes"] == 1


def test_human_tables(models, tmp_path, capsys):
    rc, out, _ = run(
        capsys, "classify", models[0], "--prompt", "Spam?", "--labels", "yes,no", *ENGINE
    )
    assert rc == 0 and "yes" in out and "no" in out and out.count("*") == 1
    ch = tmp_path / "choices.txt"
    ch.write_text("first choice\n\nsecond one\nthird\n")  # the blank line is skipped
    rc, out, _ = run(
        capsys, "score", models[0], "--context", "Pick:", "--choices-file", ch, *ENGINE
    )
    assert rc == 0 and "3 choices" in out
    assert "second one" in out and "acc_norm" in out
    rc, out, _ = run(capsys, "embed", models[0], "--prompt", "hi", "--normalize", *ENGINE)
    doc = json.loads(out)  # embed always prints JSON
    assert doc["dim"] == len(doc["embedding"]) and abs(np.linalg.norm(doc["embedding"]) - 1) < 1e-5


def test_score_choices_from_file_and_options_combine(models, api, tmp_path, capsys):
    eng, tok = api
    ch = tmp_path / "c.txt"
    ch.write_text("beta\ngamma\n")
    rc, out, _ = run(
        capsys, "score", models[0], "--context", "alpha", "--choice", "delta",
        "--choices-file", ch, "--json", *ENGINE,
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out)
    want = tasks.score(eng, tok, "alpha", ["delta", "beta", "gamma"])
    assert [c["text"] for c in doc["choices"]] == ["delta", "beta", "gamma"]
    np.testing.assert_allclose(
        [c["logprob"] for c in doc["choices"]], [c.logprob for c in want.choices]
    )
    assert doc["best"] == want.best and doc["best_norm"] == want.best_norm


# -- batches -----------------------------------------------------------------------------------
def test_classify_batch_round_trip(models, api, tmp_path, capsys):
    eng, tok = api
    reqs = [
        {"id": "a", "prompt": "Is it spam?"},
        {"id": 2, "prompt": "Is it ham?", "labels": ["ham", "spam"]},
        {"prompt": "Third", "labels": "x,y"},
        "",  # a blank line is skipped (its number still counts)
        {"id": None, "prompt": "Fourth", "method": "sequence"},
    ]
    f = jsonl(tmp_path / "in.jsonl", reqs)
    rc, out, err = run(capsys, "classify", models[0], "--labels", "yes,no", "--input", f, *ENGINE)
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 4
    docs = [json.loads(x) for x in lines]
    assert [d.get("id", "-") for d in docs] == ["a", 2, "-", None]
    assert docs[2]["line"] == 3
    assert "4 requests" in err
    expect = [("Is it spam?", ["yes", "no"]), ("Is it ham?", ["ham", "spam"]),
              ("Third", ["x", "y"]), ("Fourth", ["yes", "no"])]  # fmt: skip
    for d, (prompt, labels) in zip(docs, expect, strict=True):
        want = tasks.classify(eng, tok, prompt, labels)
        assert [s["label"] for s in d["labels"]] == labels
        np.testing.assert_allclose(
            [s["logprob"] for s in d["labels"]], [s.logprob for s in want.labels]
        )


def test_score_batch_from_stdin(models, api, tmp_path, monkeypatch, capsys):
    eng, tok = api
    ch = tmp_path / "c.txt"
    ch.write_text("one\ntwo\n")
    reqs = [{"id": i, "context": f"Context {i}:"} for i in range(3)]
    reqs.append({"id": "own", "context": "Own:", "choices": ["x", "yy", "zzz"]})
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(json.dumps(r) for r in reqs)))
    rc, out, _ = run(capsys, "score", models[0], "--choices-file", ch, "--input", "-", *ENGINE)
    assert rc == 0
    docs = [json.loads(x) for x in out.splitlines()]
    assert [d["id"] for d in docs] == [0, 1, 2, "own"]
    for d, r in zip(docs, reqs, strict=True):
        want = tasks.score(eng, tok, r["context"], r.get("choices", ["one", "two"]))
        np.testing.assert_allclose(
            [c["logprob"] for c in d["choices"]], [c.logprob for c in want.choices]
        )


def test_rerank_docs_file_and_batch(models, api, tmp_path, capsys):
    eng, tok = api
    docs_file = tmp_path / "docs.jsonl"
    docs_file.write_text('{"id": "x1", "text": "cats purr"}\n"a JSON string doc"\nplain text doc\n')
    rc, out, _ = run(
        capsys, "rerank", models[0], "--query", "cats", "--docs-file", docs_file, "--json", *ENGINE
    )
    assert rc == 0
    doc = json.loads(out)
    want = tasks.rerank(
        eng, tok, "cats", [{"id": "x1", "text": "cats purr"}, "a JSON string doc", "plain text doc"]
    )
    assert [d["id"] for d in doc["docs"]] == [d.id for d in want.docs]
    np.testing.assert_allclose([d["score"] for d in doc["docs"]], [d.score for d in want.docs])
    scores = [d["score"] for d in doc["docs"]]
    assert scores == sorted(scores, reverse=True)
    rc, out, _ = run(
        capsys, "rerank", models[0], "--query", "cats", "--docs-file", docs_file, *ENGINE
    )
    assert rc == 0 and "plain text doc" in out and "x1" in out
    f = jsonl(tmp_path / "rr.jsonl", [{"id": "q1", "query": "dogs", "docs": ["bark", {"id": 5, "text": "meow"}]},
                                      {"id": "q2", "query": "cats"}])  # fmt: skip
    rc, out, _ = run(capsys, "rerank", models[0], "--docs-file", docs_file, "--input", f, *ENGINE)
    assert rc == 0
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["id"] for x in lines] == ["q1", "q2"]
    assert sorted(d["id"] for d in lines[0]["docs"]) == [0, 5]
    assert len(lines[1]["docs"]) == 3


def test_embed_batch(models, api, tmp_path, capsys):
    eng, tok = api
    reqs = [{"id": "m", "prompt": "mean me", "pool": "mean"}, {"id": "l", "prompt": "last me"}]
    f = jsonl(tmp_path / "e.jsonl", reqs)
    rc, out, _ = run(capsys, "embed", models[0], "--input", f, "--normalize", *ENGINE)
    assert rc == 0
    docs = [json.loads(x) for x in out.splitlines()]
    assert [d["id"] for d in docs] == ["m", "l"] and [d["pool"] for d in docs] == ["mean", "last"]
    for d, r in zip(docs, reqs, strict=True):
        want = tasks.embed(eng, tok, r["prompt"], pool=r.get("pool", "last"), normalize=True)
        np.testing.assert_allclose(d["embedding"], want.embedding, rtol=1e-6)


# -- errors ------------------------------------------------------------------------------------
def test_errors_name_what_is_wrong(models, tmp_path, capsys):
    m = models[0]
    rc, _, err = run(capsys, "classify", m, "--prompt", "x", *ENGINE)
    assert rc == 2 and "no labels" in err
    rc, _, err = run(capsys, "classify", m, "--prompt", "x", "--labels", " , ", *ENGINE)
    assert rc == 2 and "no labels" in err
    rc, _, err = run(capsys, "classify", m, "--labels", "a,b", *ENGINE)
    assert rc == 2 and "--prompt" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    rc, _, err = run(capsys, "score", m, "--context", "c", "--choices-file", empty, *ENGINE)
    assert rc == 2 and "empty" in err and "empty.txt" in err
    rc, _, err = run(capsys, "score", m, "--context", "c", *ENGINE)
    assert rc == 2 and "no choices" in err
    rc, _, err = run(
        capsys, "score", m, "--context", "c", "--choices-file", tmp_path / "nope.txt", *ENGINE
    )
    assert rc == 2 and "nope.txt" in err
    rc, _, err = run(capsys, "rerank", m, "--query", "q", *ENGINE)
    assert rc == 2 and "no documents" in err
    bad_docs = tmp_path / "bad_docs.jsonl"
    bad_docs.write_text('"ok"\n{"id": 1, "text": \n')
    rc, _, err = run(capsys, "rerank", m, "--query", "q", "--docs-file", bad_docs, *ENGINE)
    assert rc == 2 and "bad_docs.jsonl:2:" in err


def test_batch_errors_name_the_line(models, tmp_path, capsys):
    m = models[0]
    f = jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": "b"}, '{"prompt": "c",'])
    rc, out, err = run(capsys, "classify", m, "--labels", "y,n", "--input", f, *ENGINE)
    assert rc == 2 and out == ""  # checked before anything runs
    assert "bad.jsonl:3: not valid JSON" in err
    f = jsonl(tmp_path / "list.jsonl", [{"prompt": "a"}, ["not", "an", "object"]])
    rc, _, err = run(capsys, "classify", m, "--labels", "y,n", "--input", f, *ENGINE)
    assert rc == 2 and "list.jsonl:2: expected a JSON object" in err
    f = jsonl(tmp_path / "field.jsonl", [{"prompt": "a", "lables": ["y"]}])
    rc, _, err = run(capsys, "classify", m, "--labels", "y,n", "--input", f, *ENGINE)
    assert rc == 2 and "field.jsonl:1: unknown field 'lables'" in err
    f = jsonl(tmp_path / "nolabels.jsonl", [{"prompt": "a", "labels": ["y"]}, {"prompt": "b"}])
    rc, _, err = run(capsys, "classify", m, "--input", f, *ENGINE)
    assert rc == 2 and "nolabels.jsonl:2: no labels" in err
    f = jsonl(tmp_path / "type.jsonl", [{"context": 3, "choices": ["a"]}])
    rc, _, err = run(capsys, "score", m, "--input", f, *ENGINE)
    assert rc == 2 and "type.jsonl:1: 'context' must be a string" in err
    f = jsonl(tmp_path / "emptychoices.jsonl", [{"context": "c", "choices": []}])
    rc, _, err = run(capsys, "score", m, "--input", f, *ENGINE)
    assert rc == 2 and "emptychoices.jsonl:1: 'choices' is empty" in err
    f = tmp_path / "blank.jsonl"
    f.write_text("\n")
    rc, _, err = run(capsys, "embed", m, "--input", f, *ENGINE)
    assert rc == 2 and "no requests" in err


# -- chat template -----------------------------------------------------------------------------
def test_template_absent_is_a_clear_error(models, capsys):
    rc, out, err = run(
        capsys, "classify", models[0], "--prompt", "x", "--labels", "a,b", "--template", *ENGINE
    )
    assert rc == 2 and out == ""
    assert "no chat template" in err and "tokenizer.chat_template" in err
    tok = Tokenizer.from_gguf(models[0])
    with pytest.raises(NoChatTemplateError):
        tasks.chat_template(models[0], tok)


def test_template_wraps_the_prompt(models, capsys):
    _, templated = models
    tok = Tokenizer.from_gguf(templated)
    bos = tok.token_text(tok.bos_id)
    tmpl = tasks.chat_template(templated, tok)
    rendered = tmpl.render("Is it spam?")
    assert rendered == f"{bos}<|user|>\nIs it spam?\n<|assistant|>\n"
    rc, out, _ = run(
        capsys, "classify", templated, "--prompt", "Is it spam?", "--labels", "yes,no",
        "--template", "--json", *ENGINE,
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out)
    # by hand: the rendered turn, control tokens parsed (BOS text → the BOS id), labels
    # appended without a delimiter (the assistant turn starts right after the template)
    ids = tok.encode(rendered, add_special=True, parse_special=True)
    assert ids[0] == tok.bos_id and doc["prompt_tokens"] == len(ids)
    with estream.load(templated, G=2, Q=2, B=2, act="f32") as eng:
        for s, lab in zip(doc["labels"], ["yes", "no"], strict=True):
            cont = tok.encode(lab)
            assert s["token_ids"] == cont
            lp = logsoftmax(eng.prefill(ids + cont, all_logits=True).logits)
            want = lp[np.arange(len(ids) - 1, len(ids) + len(cont) - 1), cont].sum()
            np.testing.assert_allclose(s["logprob"], want, **TOL)
        # rerank: the document goes inside the user turn, the answer after the assistant tag
        res = tasks.rerank(eng, tok, "cats", ["meow"], template=tmpl, answers=("yes", "no"))
        text = f"{bos}<|user|>\nQuery: cats\nDocument: meow\nRelevant (yes/no):\n<|assistant|>\n"
        ids = tok.encode(text, add_special=True, parse_special=True)
        lps = []
        for a in ("yes", "no"):
            cont = tok.encode(a)
            lp = logsoftmax(eng.prefill(ids + cont, all_logits=True).logits)
            lps.append(lp[np.arange(len(ids) - 1, len(ids) + len(cont) - 1), cont].sum())
        np.testing.assert_allclose([res.docs[0].logprob_yes, res.docs[0].logprob_no], lps, **TOL)


def test_template_is_sandboxed_and_errors_are_clear():
    evil = ChatTemplate.compile("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateRenderError):
        evil.render("x")
    refuse = ChatTemplate.compile("{{ raise_exception('only system messages') }}")
    with pytest.raises(TemplateRenderError, match="only system messages"):
        refuse.render("x")
    with pytest.raises(TemplateRenderError, match="does not compile"):
        ChatTemplate.compile("{% for %}")
    rewrites = ChatTemplate.compile("{{ messages[0]['content'] | replace('\\x00', '') }}")
    with pytest.raises(TemplateRenderError, match="rewrites"):
        rewrites.split("a", "b")


def test_batch_request_the_model_cannot_answer_gets_an_error_line(models, tmp_path, capsys):
    reqs = [
        {"id": "ok", "prompt": "fine"},
        {"id": "dup", "prompt": "x", "labels": ["a", "a"]},  # passes the check, fails to run
        {"id": "ok2", "prompt": "also fine"},
    ]
    f = jsonl(tmp_path / "mixed.jsonl", reqs)
    rc, out, err = run(capsys, "classify", models[0], "--labels", "y,n", "--input", f, *ENGINE)
    assert rc == 2
    docs = [json.loads(x) for x in out.splitlines()]
    assert [d["id"] for d in docs] == ["ok", "dup", "ok2"]
    assert "labels" in docs[0] and "labels" in docs[2]
    assert docs[1]["error"].startswith(f"{f}:2: ") and "twice" in docs[1]["error"]
    assert "3 requests" in err and "1 failed" in err


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(models, tmp_path, monkeypatch):
    f = jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    out, err = io.StringIO(), _TTY()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["embed", str(models[0]), "--input", f, *ENGINE]) == 0
    assert len(out.getvalue().splitlines()) == 4
    bar = err.getvalue()
    assert "\r" in bar and "4/4" in bar and "1/4" in bar and "4 requests" in bar


@pytest.mark.parametrize("task", ["classify", "score", "rerank", "embed"])
def test_batch_shares_passes_and_a_bad_request_keeps_its_line(models, api, tmp_path, capsys, task):
    """A JSONL batch runs its requests in shared passes (the default budget takes them all);
    a request longer than the context fails on its own line, the others are answered as alone;
    --batch-tokens 1 gives every request passes of its own with the same answers."""
    eng, _tok = api
    too_long = "z " * (eng.hp.n_ctx + 8)
    field = {"classify": "prompt", "score": "context", "rerank": "query", "embed": "prompt"}[task]
    texts = ["First one", too_long, "Second", "Third and last"]
    reqs = [{"id": i, field: t} for i, t in enumerate(texts)]
    extra = {
        "classify": ["--labels", "yes,no maybe"],
        "score": ["--choice", "up", "--choice", "down below"],
        "rerank": ["--docs-file", str(jsonl(tmp_path / "d.txt", ["cats", "dogs bark"]))],
        "embed": [],
    }[task]
    f = jsonl(tmp_path / "b.jsonl", reqs)
    rc, out, err = run(capsys, task, models[0], "--input", f, *extra, *ENGINE)
    assert rc == 2 and "1 failed" in err
    docs = [json.loads(x) for x in out.splitlines()]
    assert [d["id"] for d in docs] == [0, 1, 2, 3]
    assert "longer than the model context" in docs[1]["error"]
    ok = [docs[i] for i in (0, 2, 3)]
    ids = {p["pass_id"] for d in ok for p in d["metrics"]["pass"]}
    assert len(ids) == 1 and "in 1 pass," in err  # the three answered requests share a pass
    assert all(d["metrics"]["pass"][0]["requests"] == 3 for d in ok)
    rc1, out1, _err1 = run(
        capsys, task, models[0], "--input", f, *extra, "--batch-tokens", "1", *ENGINE
    )
    assert rc1 == 2
    alone = [json.loads(x) for x in out1.splitlines()]
    assert len({p["pass_id"] for i in (0, 2, 3) for p in alone[i]["metrics"]["pass"]}) >= 3

    def numbers(d):
        if task == "embed":
            return d["embedding"]
        key = {"classify": "labels", "score": "choices", "rerank": "docs"}[task]
        return [x.get("logprob", x.get("score")) for x in d[key]]

    for i in (0, 2, 3):
        np.testing.assert_allclose(numbers(docs[i]), numbers(alone[i]), rtol=1e-5, atol=1e-6)
        assert docs[i]["metrics"]["tokens"] == alone[i]["metrics"]["tokens"]
