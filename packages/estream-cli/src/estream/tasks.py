"""Prefill-only tasks on text: classify, score, rerank, embed.

Each task turns text into token ids with the model's own tokenizer, runs as few forward passes
as it can (shared prefixes go through `Engine.prefill_branches`, so the experts are streamed
once for all continuations) and reads the answer off the logits or the hidden state.

How a continuation (a label, a choice, an answer) is tokenized — the *in-context rule*:

1. Without a chat template, a delimiter (default ``" "``) joins context and continuation unless
   the context is empty, already ends in whitespace, or the continuation starts with it; then
   trailing spaces (U+0020 only) of the context move to the continuation (lm-eval's rule): a
   context ``"Answer: "`` with label ``"yes"`` is scored as ``"Answer:"`` + ``" yes"``, the way
   the text would have been tokenized in training. Newlines stay in the context.
2. With a chat template the rendered prompt ends at the start of the assistant turn, and the
   continuation is the text as given (no delimiter, nothing moved).
3. The continuation's ids are those of ``context + continuation`` tokenized as a whole, after
   the ids of ``context`` (when the latter are a prefix of the former, which holds unless a
   token spans the boundary); otherwise the continuation is tokenized alone.

The context is tokenized with ``add_special=True`` (BOS as the model asks, like
``estream prefill``); control tokens in the text are parsed only when a chat template is used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from .errors import BadRequestError, json_kind
from .template import ChatTemplate

__all__ = [
    "CLASSIFY_METHODS",
    "LOGITS_BUDGET_BYTES",
    "PASS_KEYS",
    "POOLS",
    "RERANK_PROMPT",
    "ChoiceScore",
    "ClassifyResult",
    "DocScore",
    "EmbedResult",
    "LabelScore",
    "Plan",
    "RerankResult",
    "ScoreResult",
    "chat_template",
    "classify",
    "continuation_ids",
    "embed",
    "encode_context",
    "plan_classify",
    "plan_embed",
    "plan_rerank",
    "plan_score",
    "rerank",
    "run_plans",
    "score",
    "split_context",
]

CLASSIFY_METHODS = ("auto", "first-token", "sequence")
POOLS = ("last", "mean")
#: The rerank judgement prompt; ``{document}`` varies, everything before it is shared.
RERANK_PROMPT = "Query: {query}\nDocument: {document}\nRelevant (yes/no):"


# -- tokenization ------------------------------------------------------------------------------
def chat_template(model: str | os.PathLike[str], tokenizer: Any) -> ChatTemplate:
    """The chat template of a model (packed dir or GGUF), with its vocabulary's BOS/EOS
    strings; `NoChatTemplateError` when it has none."""

    def text(i: int | None) -> str:
        return tokenizer.token_text(i) if i is not None and 0 <= i < tokenizer.n_vocab else ""

    return ChatTemplate.from_gguf(
        model, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id)
    )


def split_context(
    context: str, continuation: str, *, delimiter: str = " ", templated: bool = False
) -> tuple[str, str]:
    """Where the context ends and the continuation starts (rules 1–2 of the module doc)."""
    if templated:
        return context, continuation
    if context and not context[-1].isspace() and not continuation[:1].isspace():
        continuation = delimiter + continuation
    stripped = context.rstrip(" ")
    return stripped, context[len(stripped) :] + continuation


def encode_context(tokenizer: Any, text: str, *, parse_special: bool = False) -> list[int]:
    """Ids of a context: BOS as the model asks, never a trailing EOS (text follows it), and a
    single BOS when a chat template already wrote one."""
    ids = list(tokenizer.encode(text, add_special=True, parse_special=parse_special))
    bos = tokenizer.bos_id
    if tokenizer.add_bos and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    if tokenizer.add_eos and ids and ids[-1] == tokenizer.eos_id:
        ids = ids[:-1]
    return ids


def continuation_ids(
    tokenizer: Any, context: str, continuation: str, *, parse_special: bool = False
) -> list[int]:
    """Ids of ``continuation`` as tokenized after ``context`` (rule 3 of the module doc)."""
    head = tokenizer.encode(context, parse_special=parse_special)
    whole = tokenizer.encode(context + continuation, parse_special=parse_special)
    if whole[: len(head)] == head:
        return list(whole[len(head) :])
    return list(tokenizer.encode(continuation))


def _prompt_text(template: ChatTemplate | None, text: str) -> str:
    return template.render(text) if template is not None else text


def _need_context(ids: Sequence[int], what: str) -> None:
    if not ids:
        raise BadRequestError(
            f"the {what} is empty and the model adds no BOS token: there is nothing to predict "
            "the first token from; give a non-empty text"
        )


# -- numerics ----------------------------------------------------------------------------------
def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _normalize(logps: Sequence[float]) -> np.ndarray:
    a = np.asarray(logps, dtype=np.float64)
    p = np.exp(a - a.max())
    return p / p.sum()


#: What a task result's ``metrics["pass"]`` keeps of each pass it ran in.
PASS_KEYS = ("pass_id", "requests", "tokens", "ttft_s", "bytes_read", "peak_memory_bytes")


def _merge_metrics(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A task request's metrics from its engine requests' (`Engine.prefill_many`): its own
    ``tokens``, the number of ``passes`` it ran in, and under ``pass`` a summary of each of
    those passes (`PASS_KEYS`: they may be shared with other requests of a batch, so sum
    ``bytes_read`` or ``ttft_s`` over distinct ``pass_id``s)."""
    passes: dict[int, Mapping[str, Any]] = {}
    for r in runs:
        p = r.get("pass", r)
        passes.setdefault(int(p.get("pass_id", len(passes))), p)
    return {
        "tokens": sum(int(r["tokens"]) for r in runs),
        "passes": len(passes),
        "pass": [{k: p[k] for k in PASS_KEYS if k in p} for p in passes.values()],
    }


@attrs.frozen
class Plan:
    """One task request as engine requests (`Engine.prefill_many`) and how to read its answer
    off their results: ``finish(results, metrics)``. ``hidden``: the results need the hidden
    state. Plans of many task requests run together in `run_plans`. The ``plan_*`` functions
    read only ``engine.hp`` (the model's hyperparameters): a command can plan its requests
    before it loads the model."""

    requests: list[Any]
    finish: Callable[[list[Any], dict[str, Any]], Any]
    hidden: bool = False

    def longest_request(self) -> int:
        """Tokens of the plan's longest engine request (a branch request: its prefix and
        every branch), the shortest pass that runs it."""
        from .engine import BranchRequest

        def size(r: Any) -> int:
            if isinstance(r, BranchRequest):
                return len(r.prefix) + sum(len(b) for b in r.branches)
            return len(r)

        return max((size(r) for r in self.requests), default=0)


def run_plans(
    engine: Any,
    plans: Iterable[Plan | BaseException],
    *,
    batch_tokens: int | None = None,
) -> Iterator[Any]:
    """Answers of ``plans`` in order, their engine requests batched across plans into passes of
    at most ``batch_tokens`` tokens. A plan whose request failed (or that is itself an
    exception: a request that could not be planned) yields its exception in its place; the
    others are answered."""
    plans = list(plans)
    flat: list[Any] = []
    owner: list[int] = []
    for i, p in enumerate(plans):
        if isinstance(p, Plan):
            flat += p.requests
            owner += [i] * len(p.requests)
    hidden = any(isinstance(p, Plan) and p.hidden for p in plans)
    results = engine.prefill_many(
        flat, batch_tokens=batch_tokens, return_hidden=hidden, return_exceptions=True
    )
    done: dict[int, list[Any]] = {}
    nxt = 0

    def ready() -> Iterator[Any]:
        nonlocal nxt
        while nxt < len(plans):
            p = plans[nxt]
            if isinstance(p, BaseException):
                yield p
            else:
                got = done.get(nxt, [])
                if len(got) < len(p.requests):
                    return
                err = next((r for r in got if isinstance(r, BaseException)), None)
                if err is not None:
                    yield err
                else:
                    try:
                        yield p.finish(got, _merge_metrics([r.metrics for r in got]))
                    except Exception as exc:
                        yield exc
                done.pop(nxt, None)
            nxt += 1

    yield from ready()
    for i, res in zip(owner, results, strict=True):
        done.setdefault(i, []).append(res)
        yield from ready()
    yield from ready()


def _run_one(engine: Any, plan: Plan, batch_tokens: int | None = None) -> Any:
    (res,) = run_plans(engine, [plan], batch_tokens=batch_tokens)
    if isinstance(res, BaseException):
        raise res
    return res


@attrs.frozen
class _Branch:
    token_logprobs: np.ndarray  # log P of each branch token given prefix + earlier tokens
    greedy: np.ndarray  # whether each token was the argmax
    last_logprobs: np.ndarray | None  # log-softmax after the branch's last token


#: Upper bound on the float32 logits one shared-prefix pass may return (every branch position
#: gets a full vocabulary row): 512 MiB is ~880 tokens per pass for a 152k vocabulary.
LOGITS_BUDGET_BYTES = 512 << 20


def _pass_tokens(engine: Any, max_tokens: int | None) -> int:
    if max_tokens is not None:
        return int(max_tokens)
    by_memory = LOGITS_BUDGET_BYTES // (4 * int(engine.hp.n_vocab))
    return max(64, min(int(engine.hp.n_ctx), by_memory))


def _row_logprobs(rows: np.ndarray, toks: np.ndarray, chunk: int = 64) -> np.ndarray:
    """log-softmax(rows)[k, toks[k]] without a float64 copy of the whole [n, V] block."""
    out = np.empty(len(toks), dtype=np.float64)
    for a in range(0, len(toks), chunk):
        z = rows[a : a + chunk].astype(np.float64)
        m = z.max(axis=1)
        lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
        out[a : a + chunk] = z[np.arange(len(z)), toks[a : a + chunk]] - lse
    return out


def _branch_requests(
    engine: Any,
    prefix: Sequence[int],
    branches: Sequence[Sequence[int]],
    *,
    max_tokens: int | None = None,
) -> list[Any]:
    """Shared-prefix requests over ``branches``, as few as fit in ``max_tokens`` tokens each
    (default: the model context, capped so the returned logits stay within
    `LOGITS_BUDGET_BYTES`); a branch longer than that still gets its own request."""
    from .engine import BranchRequest

    for i, b in enumerate(branches):
        if not b:
            raise BadRequestError(f"continuation {i + 1} tokenizes to nothing")
    limit = _pass_tokens(engine, max_tokens)
    groups: list[list[int]] = []
    total = len(prefix)
    for i, b in enumerate(branches):
        if groups and total + len(b) <= limit:
            groups[-1].append(i)
            total += len(b)
        else:
            groups.append([i])
            total = len(prefix) + len(b)
    return [BranchRequest(prefix, [branches[i] for i in g]) for g in groups]


def _read_branches(
    results: Sequence[Any], branches: Sequence[Sequence[int]], *, want_last: bool = False
) -> list[_Branch]:
    """Per-branch log-likelihoods from the results of `_branch_requests` (in order)."""
    out: list[_Branch] = []
    i = 0
    for res in results:
        for bl in res.branch_logits:
            toks = np.asarray(branches[i], dtype=np.int64)
            n = len(toks)
            rows = np.vstack([res.prefix_logits[None, :], bl[: n - 1]])  # rows predicting toks
            greedy = rows.argmax(axis=1) == toks
            last = _log_softmax(bl[n - 1]) if want_last else None
            out.append(_Branch(_row_logprobs(rows, toks), greedy, last))
            i += 1
    return out


# -- classify ----------------------------------------------------------------------------------
@attrs.frozen
class LabelScore:
    label: str
    token_ids: tuple[int, ...]
    logprob: float  # log P(label | prompt): first token only for method "first-token"
    first_token_logprob: float  # log P(first token | prompt), over the whole vocabulary
    prob: float  # normalised over the labels

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False) | {"token_ids": list(self.token_ids)}


@attrs.frozen
class ClassifyResult:
    labels: tuple[LabelScore, ...]
    best: str
    method: str  # "first-token" or "sequence"
    prompt_tokens: int
    metrics: dict[str, Any] = attrs.field(eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "labels": [s.to_dict() for s in self.labels],
            "metrics": self.metrics,
        }


def _check_texts(items: Sequence[str], what: str) -> list[str]:
    if isinstance(items, str):
        raise BadRequestError(f"{what} must be a list of strings, not one string")
    items = list(items)
    if not items:
        raise BadRequestError(f"no {what} given")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise BadRequestError(f"{what} {i + 1} is {json_kind(s)}, not a string")
        if not s.strip():
            raise BadRequestError(f"{what} {i + 1} is empty")
    return items


def classify(
    engine: Any,
    tokenizer: Any,
    prompt: str,
    labels: Sequence[str],
    *,
    method: str = "auto",
    delimiter: str = " ",
    template: ChatTemplate | None = None,
) -> ClassifyResult:
    """Probability of each label as the continuation of ``prompt``.

    ``method``: ``"first-token"`` — softmax over the next-token logits of each label's first
    token (one plain prefill); ``"sequence"`` — the whole label's log-likelihood, all labels
    as branches of one shared-prefix pass; ``"auto"`` (default) — first-token when every label
    is a single token (then both agree), else sequence."""
    plan = plan_classify(
        engine, tokenizer, prompt, labels, method=method, delimiter=delimiter, template=template
    )
    return _run_one(engine, plan)  # type: ignore[no-any-return]


def plan_classify(
    engine: Any,
    tokenizer: Any,
    prompt: str,
    labels: Sequence[str],
    *,
    method: str = "auto",
    delimiter: str = " ",
    template: ChatTemplate | None = None,
) -> Plan:
    """`classify` as a `Plan` (its requests checked and tokenized, nothing run)."""
    if method not in CLASSIFY_METHODS:
        raise BadRequestError(
            f"method must be one of {', '.join(CLASSIFY_METHODS)}, got {method!r}"
        )
    labels = _check_texts(labels, "label")
    dup = {s for s in labels if labels.count(s) > 1}
    if dup:
        raise BadRequestError(f"label {sorted(dup)[0]!r} is given twice")
    text = _prompt_text(template, prompt)
    ps = template is not None
    pieces = [split_context(text, lab, delimiter=delimiter, templated=ps) for lab in labels]
    ctx = pieces[0][0]  # the same for every label: only trailing spaces move
    ids = encode_context(tokenizer, ctx, parse_special=ps)
    _need_context(ids, "prompt")
    label_ids = [continuation_ids(tokenizer, ctx, cont, parse_special=ps) for _, cont in pieces]
    for lab, li in zip(labels, label_ids, strict=True):
        if not li:
            raise BadRequestError(f"label {lab!r} tokenizes to nothing")
    firsts = [li[0] for li in label_ids]
    if method == "auto":
        method = "first-token" if all(len(li) == 1 for li in label_ids) else "sequence"

    def answer(logps: list[float], first_lp: list[float], metrics: dict[str, Any]) -> Any:
        probs = _normalize(logps)
        scores = tuple(
            LabelScore(lab, tuple(li), lp_, f, float(p))
            for lab, li, lp_, f, p in zip(labels, label_ids, logps, first_lp, probs, strict=True)
        )
        best = labels[int(np.argmax(logps))]
        return ClassifyResult(scores, best, method, len(ids), metrics)

    if method == "first-token":
        for a in range(len(labels)):
            for b in range(a):
                if firsts[a] == firsts[b]:
                    raise BadRequestError(
                        f"labels {labels[b]!r} and {labels[a]!r} start with the same token "
                        f"({firsts[a]}): use method 'sequence' or labels that differ in "
                        "their first token"
                    )

        def finish_first(results: list[Any], metrics: dict[str, Any]) -> Any:
            lp = _log_softmax(results[0].logits)
            first_lp = [float(lp[t]) for t in firsts]
            return answer(first_lp, first_lp, metrics)

        return Plan([ids], finish_first)
    if len({tuple(li) for li in label_ids}) < len(label_ids):
        raise BadRequestError("two labels tokenize to the same ids; make them differ")

    def finish_seq(results: list[Any], metrics: dict[str, Any]) -> Any:
        branches = _read_branches(results, label_ids)
        logps = [float(b.token_logprobs.sum()) for b in branches]
        first_lp = [float(b.token_logprobs[0]) for b in branches]
        return answer(logps, first_lp, metrics)

    return Plan(_branch_requests(engine, ids, label_ids), finish_seq)


# -- score -------------------------------------------------------------------------------------
@attrs.frozen
class ChoiceScore:
    text: str
    token_ids: tuple[int, ...]
    logprob: float  # Σ log P(token | context, earlier tokens)
    logprob_per_token: float
    logprob_per_char: float  # lm-eval acc_norm: divided by len(choice) in characters
    logprob_per_byte: float  # divided by the choice's UTF-8 length
    greedy: bool  # every token was the model's argmax

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)
        return d | {"token_ids": list(self.token_ids), "n_tokens": self.n_tokens}


@attrs.frozen
class ScoreResult:
    choices: tuple[ChoiceScore, ...]
    best: int  # index of the highest summed log-likelihood (lm-eval acc)
    best_norm: int  # index of the highest per-character log-likelihood (lm-eval acc_norm)
    context_tokens: int
    metrics: dict[str, Any] = attrs.field(eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_norm": self.best_norm,
            "context_tokens": self.context_tokens,
            "choices": [c.to_dict() for c in self.choices],
            "metrics": self.metrics,
        }


def score(
    engine: Any,
    tokenizer: Any,
    context: str,
    choices: Sequence[str],
    *,
    delimiter: str = " ",
    template: ChatTemplate | None = None,
    max_tokens: int | None = None,
) -> ScoreResult:
    """Log-likelihood of each choice as the continuation of ``context`` (HellaSwag/ARC style).

    The context is prefilled once; all choices are branches of the same pass (split into
    several passes only when they exceed ``max_tokens``, default the model context)."""
    plan = plan_score(
        engine,
        tokenizer,
        context,
        choices,
        delimiter=delimiter,
        template=template,
        max_tokens=max_tokens,
    )
    return _run_one(engine, plan, max_tokens)  # type: ignore[no-any-return]


def plan_score(
    engine: Any,
    tokenizer: Any,
    context: str,
    choices: Sequence[str],
    *,
    delimiter: str = " ",
    template: ChatTemplate | None = None,
    max_tokens: int | None = None,
) -> Plan:
    """`score` as a `Plan`."""
    choices = _check_texts(choices, "choice")
    text = _prompt_text(template, context)
    ps = template is not None
    pieces = [split_context(text, c, delimiter=delimiter, templated=ps) for c in choices]
    ctx = pieces[0][0]
    ids = encode_context(tokenizer, ctx, parse_special=ps)
    _need_context(ids, "context")
    cont = [continuation_ids(tokenizer, ctx, c, parse_special=ps) for _, c in pieces]
    for c, ci in zip(choices, cont, strict=True):
        if not ci:
            raise BadRequestError(f"choice {c!r} tokenizes to nothing")

    def finish(results: list[Any], metrics: dict[str, Any]) -> ScoreResult:
        branches = _read_branches(results, cont)
        out = []
        for c, ci, b in zip(choices, cont, branches, strict=True):
            s = float(b.token_logprobs.sum())
            out.append(
                ChoiceScore(
                    text=c,
                    token_ids=tuple(ci),
                    logprob=s,
                    logprob_per_token=s / len(ci),
                    logprob_per_char=s / len(c),
                    logprob_per_byte=s / len(c.encode("utf-8")),
                    greedy=bool(b.greedy.all()),
                )
            )
        best = int(np.argmax([c.logprob for c in out]))
        best_norm = int(np.argmax([c.logprob_per_char for c in out]))
        return ScoreResult(tuple(out), best, best_norm, len(ids), metrics)

    return Plan(_branch_requests(engine, ids, cont, max_tokens=max_tokens), finish)


# -- rerank ------------------------------------------------------------------------------------
@attrs.frozen
class DocScore:
    index: int  # position in the input
    id: Any  # the caller's id (the index when none was given)
    score: float  # log P(yes) − log P(no)
    logprob_yes: float
    logprob_no: float
    doc_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False)


@attrs.frozen
class RerankResult:
    docs: tuple[DocScore, ...]  # sorted by score, highest first (ties: input order)
    query_tokens: int  # tokens of the shared part (prompt up to the document)
    metrics: dict[str, Any] = attrs.field(eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "query_tokens": self.query_tokens,
            "docs": [d.to_dict() for d in self.docs],
            "metrics": self.metrics,
        }


def _doc_items(docs: Sequence[Any]) -> list[tuple[Any, str]]:
    if isinstance(docs, str):
        raise BadRequestError("docs must be a list, not one string")
    items = []
    for i, d in enumerate(docs):
        if isinstance(d, str):
            items.append((i, d))
        elif isinstance(d, Mapping) and isinstance(d.get("text"), str):
            items.append((d.get("id", i), d["text"]))
        else:
            raise BadRequestError(
                f"document {i + 1} must be a string or an object with a 'text' string"
            )
    if not items:
        raise BadRequestError("no documents given")
    for i, (_, t) in enumerate(items):
        if not t.strip():
            raise BadRequestError(f"document {i + 1} is empty")
    return items


def rerank(
    engine: Any,
    tokenizer: Any,
    query: str,
    docs: Sequence[str | Mapping[str, Any]],
    *,
    answers: tuple[str, str] = ("yes", "no"),
    template: ChatTemplate | None = None,
    max_tokens: int | None = None,
) -> RerankResult:
    """Relevance of each document to ``query``: log P(yes) − log P(no) after `RERANK_PROMPT`,
    sorted descending.

    The query part of the prompt (``"Query: …\\nDocument:"``) is the shared prefix; each
    document plus the question suffix is a branch of one pass. When both answers are single
    tokens, their log-probabilities are read after each branch's last token; otherwise each
    document is a branch twice, once ending in each answer, and the answers' whole
    log-likelihoods are compared. ``docs``: strings or ``{"id": …, "text": …}``."""
    plan = plan_rerank(
        engine, tokenizer, query, docs, answers=answers, template=template, max_tokens=max_tokens
    )
    return _run_one(engine, plan, max_tokens)  # type: ignore[no-any-return]


def plan_rerank(
    engine: Any,
    tokenizer: Any,
    query: str,
    docs: Sequence[str | Mapping[str, Any]],
    *,
    answers: tuple[str, str] = ("yes", "no"),
    template: ChatTemplate | None = None,
    max_tokens: int | None = None,
) -> Plan:
    """`rerank` as a `Plan`."""
    items = _doc_items(docs)
    yes, no = answers
    if not yes.strip() or not no.strip() or yes == no:
        raise BadRequestError(f"answers must be two different non-empty words, got {answers!r}")
    before, after = RERANK_PROMPT.split("{document}")
    before = before.format(query=query)
    ps = template is not None
    if template is not None:
        before, after = template.split(before, after)
    head_text, _ = split_context(before, "x", delimiter="", templated=ps)  # strip trailing spaces
    moved = before[len(head_text) :]
    ids = encode_context(tokenizer, head_text, parse_special=ps)
    _need_context(ids, "query prompt")
    doc_ids = [
        continuation_ids(tokenizer, head_text, moved + text + after, parse_special=ps)
        for _, text in items
    ]
    ans = []
    for a in (yes, no):
        ctx, cont = split_context(after, a, templated=ps)
        ans.append(continuation_ids(tokenizer, ctx, cont, parse_special=ps))
    single = len(ans[0]) == 1 and len(ans[1]) == 1 and ans[0] != ans[1]
    both = doc_ids if single else [d + a for d in doc_ids for a in ans]

    def finish(results: list[Any], metrics: dict[str, Any]) -> RerankResult:
        branches = _read_branches(results, both, want_last=single)
        if single:
            lps = [
                (float(b.last_logprobs[ans[0][0]]), float(b.last_logprobs[ans[1][0]]))  # type: ignore[index]
                for b in branches
            ]
        else:
            lps = []
            for k, d in enumerate(doc_ids):
                pair = [float(branches[2 * k + j].token_logprobs[len(d) :].sum()) for j in (0, 1)]
                lps.append((pair[0], pair[1]))
        scores = [
            DocScore(i, doc_id, y - n, y, n, len(d))
            for i, ((doc_id, _), (y, n), d) in enumerate(zip(items, lps, doc_ids, strict=True))
        ]
        scores.sort(key=lambda s: (-s.score, s.index))
        return RerankResult(tuple(scores), len(ids), metrics)

    return Plan(_branch_requests(engine, ids, both, max_tokens=max_tokens), finish)


# -- embed -------------------------------------------------------------------------------------
@attrs.frozen
class EmbedResult:
    embedding: np.ndarray  # [d] float32
    pool: str
    normalized: bool
    tokens: int
    metrics: dict[str, Any] = attrs.field(eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "embedding": [float(v) for v in self.embedding],
            "dim": int(self.embedding.size),
            "pool": self.pool,
            "normalized": self.normalized,
            "tokens": self.tokens,
            "metrics": self.metrics,
        }


def embed(
    engine: Any,
    tokenizer: Any,
    prompt: str,
    *,
    pool: str = "last",
    normalize: bool = False,
    template: ChatTemplate | None = None,
) -> EmbedResult:
    """The final-normed hidden state of the prompt: its last token's (``pool="last"``) or the
    mean over all its tokens, BOS included (``"mean"``); L2-normalised when ``normalize``."""
    plan = plan_embed(engine, tokenizer, prompt, pool=pool, normalize=normalize, template=template)
    return _run_one(engine, plan)  # type: ignore[no-any-return]


def plan_embed(
    engine: Any,
    tokenizer: Any,
    prompt: str,
    *,
    pool: str = "last",
    normalize: bool = False,
    template: ChatTemplate | None = None,
) -> Plan:
    """`embed` as a `Plan`."""
    if pool not in POOLS:
        raise BadRequestError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
    ps = template is not None
    ids = encode_context(tokenizer, _prompt_text(template, prompt), parse_special=ps)
    _need_context(ids, "prompt")

    def finish(results: list[Any], metrics: dict[str, Any]) -> EmbedResult:
        h = np.asarray(results[0].hidden, dtype=np.float64)
        v = h[-1] if pool == "last" else h.mean(axis=0)
        if normalize:
            n = float(np.linalg.norm(v))
            if n > 0:
                v = v / n
        return EmbedResult(v.astype(np.float32), pool, normalize, len(ids), metrics)

    return Plan([ids], finish, hidden=True)
