"""Accuracy evaluation of a (streamed) model: perplexity, multiple choice, cloze.

The point is to check that a model run by EStream answers as well as the same model elsewhere
(llama.cpp's ``llama-perplexity``, lm-evaluation-harness): the conventions below are theirs,
stated exactly so that the numbers can be compared.

**Perplexity** (`perplexity`, llama-perplexity's convention). The text is tokenized whole with
the model's tokenizer, BOS first when the model adds one (``add_bos``), no EOS. It is cut into
windows of ``ctx`` tokens starting at token ``0, stride, 2·stride, …`` (default stride: ``ctx``,
non-overlapping windows, as llama-perplexity without ``--ppl-stride``); only whole windows are
used, so ``(N − ctx) // stride + 1`` windows for ``N`` tokens, and the text must have at least
``ctx`` tokens. When the model adds BOS, the first token of every window is replaced by BOS
(window 0 starts with it already), as llama-perplexity does. Each window is one independent
forward pass from an empty context; the last ``n_score = min(stride, ctx − 1 − ctx // 2)``
positions of a window are scored (each from the logits of the position before it), the rest
are context. With the default stride this is llama-perplexity's "second half": positions
``ctx // 2 + 1 … ctx − 1``; with ``stride ≤ ctx − 1 − ctx // 2`` it is the last ``stride``
positions (llama-perplexity's ``--ppl-stride`` scoring), so no token is scored twice. The first
``ctx − n_score`` tokens of the text are context only, never scored.

* perplexity = exp(mean NLL), NLL = −ln P(token) in nats over all scored tokens;
* its ± is llama-perplexity's: the standard error of the mean NLL, sqrt((mean(NLL²) −
  mean(NLL)²) / (n − 1)), times the perplexity (the delta method through exp); the 95 % interval
  is exp(mean NLL ± 1.96 · that error);
* bits per byte = Σ NLL / ln 2 / B, where B counts the UTF-8 bytes of the scored tokens only —
  each scored token's own bytes as the tokenizer renders it (`Tokenizer.token_to_bytes`: the
  byte-level BPE bytes; for SentencePiece "▁" is one space byte and a byte token one byte).

**Multiple choice** (`multiple_choice`): one item is a context, its choices and the index of the
gold choice. Each choice is scored as the continuation of the context by `tasks.score` (one
shared-prefix pass per item, the choices its branches; the context/choice boundary follows the
in-context rule of `estream.tasks`: a space joins them, the choice's ids are those of
``context + choice`` tokenized whole after the context's ids). Four predictions per item, the
argmax (ties: the lower index) of: the summed log-probability of the choice (``acc``), the
average log-probability per token of the choice (``acc_per_token``: llama.cpp's HellaSwag
score), per character of the choice text (``acc_per_char``: lm-eval's ``acc_norm``) and per
UTF-8 byte (``acc_per_byte``).

**Cloze** (`cloze`, LAMBADA style): the last whitespace-separated word of a passage is the
target, the text before it the context (the space before the word moves into the word, as in
the in-context rule). There is no decoding here (prefill only), so the prediction is correct
when every token of the word is the argmax of the logits given the context and the word's
earlier tokens (greedy decoding would produce it: one pass over context + word, all logits);
the mean over passages of the word's summed log-probability is reported too, with the word
perplexity exp(−mean).

Accuracies carry the standard error sqrt(p(1 − p)/n) and the normal 95 % interval p ± 1.96 ·
that error, clipped to [0, 1]; means the standard error of the mean (sample standard deviation
/ sqrt(n)). A figure whose error is undefined (one sample) has ``stderr`` null.

Forward passes go through `_window_logits`, one streamed pass per batch of windows; each
window's ``[T, n_vocab]`` logits are reduced to the few numbers needed as soon as they arrive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from . import tasks
from .errors import BadRequestError, json_kind
from .tasks import LOGITS_BUDGET_BYTES, _merge_metrics, _row_logprobs, encode_context

__all__ = [
    "CHOICE_RULES",
    "DEFAULT_PPL_CTX",
    "Z95",
    "ChoiceItem",
    "ChoiceResult",
    "ClozeItem",
    "ClozeResult",
    "Estimate",
    "PerplexityResult",
    "cloze",
    "multiple_choice",
    "perplexity",
    "perplexity_windows",
    "split_last_word",
]

#: ``--ctx`` when none is given (llama-perplexity's customary ``-c 512``), capped by the model.
DEFAULT_PPL_CTX = 512
#: Two-sided 95 % normal quantile.
Z95 = 1.959963984540054

Progress = Callable[[int, int], None]


# -- statistics --------------------------------------------------------------------------------
@attrs.frozen
class Estimate:
    """A figure with its standard error and 95 % interval (``stderr`` None: undefined)."""

    value: float
    stderr: float | None
    ci95: tuple[float, float] | None

    def to_dict(self) -> dict[str, Any]:
        ci = None if self.ci95 is None else [self.ci95[0], self.ci95[1]]
        return {"value": self.value, "stderr": self.stderr, "ci95": ci}


def proportion(k: int, n: int) -> Estimate:
    """Accuracy k/n with the binomial standard error sqrt(p(1-p)/n), normal 95 % interval."""
    p = k / n
    se = math.sqrt(p * (1.0 - p) / n)
    return Estimate(p, se, (max(0.0, p - Z95 * se), min(1.0, p + Z95 * se)))


def mean_estimate(values: Sequence[float]) -> Estimate:
    """Mean with the standard error of the mean (sample standard deviation / sqrt(n))."""
    a = np.asarray(values, dtype=np.float64)
    m = float(a.mean())
    if a.size < 2:
        return Estimate(m, None, None)
    se = float(a.std(ddof=1) / math.sqrt(a.size))
    return Estimate(m, se, (m - Z95 * se, m + Z95 * se))


# -- forward passes ----------------------------------------------------------------------------
def _batches(engine: Any, windows: Sequence[Sequence[int]]) -> Iterator[list[Sequence[int]]]:
    """Consecutive windows whose float32 logits together stay within `LOGITS_BUDGET_BYTES`
    and whose tokens fit the engine's pass size for all-position logits
    (`Engine.default_batch_tokens`); a window larger than that is a batch of its own."""
    limit = max(1, LOGITS_BUDGET_BYTES // (4 * int(engine.hp.n_vocab)))
    limit = min(limit, int(engine.default_batch_tokens(all_logits=True)))
    batch: list[Sequence[int]] = []
    total = 0
    for w in windows:
        if batch and total + len(w) > limit:
            yield batch
            batch, total = [], 0
        batch.append(w)
        total += len(w)
    if batch:
        yield batch


def _window_logits(
    engine: Any, windows: Sequence[Sequence[int]], runs: list[dict[str, Any]]
) -> Iterator[np.ndarray]:
    """The all-position logits ``[len(w), n_vocab]`` of each window, in order: each window is
    an independent sequence (positions from 0, empty context). One streamed pass per batch of
    windows (`Engine.prefill_batch`: the windows are independent sequences of one pass); the
    metrics of every pass are appended to ``runs``. Callers must reduce each array before
    asking for the next one (memory stays one batch of logits)."""
    for batch in _batches(engine, windows):
        results = engine.prefill_batch(batch, all_logits=True)
        runs.extend(r.metrics for r in results)
        while results:
            logits = results.pop(0).logits
            yield logits
            del logits


# -- perplexity --------------------------------------------------------------------------------
@attrs.frozen
class PerplexityResult:
    perplexity: Estimate
    nll: Estimate  # mean NLL per scored token, nats
    bits_per_byte: Estimate
    ctx: int
    stride: int
    n_score: int  # scored positions per window (the last ones)
    windows: int
    tokens: int  # tokens of the whole text (BOS included when the model adds it)
    scored_tokens: int
    scored_bytes: int
    bos: bool  # each window starts with BOS
    window_perplexity: tuple[float, ...]
    metrics: dict[str, Any] = attrs.field(eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": "perplexity",
            "perplexity": self.perplexity.to_dict(),
            "nll": self.nll.to_dict(),
            "bits_per_byte": self.bits_per_byte.to_dict(),
            "count": self.scored_tokens,
            "scored_tokens": self.scored_tokens,
            "scored_bytes": self.scored_bytes,
            "tokens": self.tokens,
            "windows": self.windows,
            "ctx": self.ctx,
            "stride": self.stride,
            "scored_per_window": self.n_score,
            "bos": self.bos,
            "window_perplexity": list(self.window_perplexity),
            "metrics": self.metrics,
        }


def check_window(ctx: Any, stride: Any, n_ctx: int) -> tuple[int, int]:
    """Validated (ctx, stride): 3 ≤ ctx ≤ the model context, 1 ≤ stride ≤ ctx."""
    if isinstance(ctx, bool) or not isinstance(ctx, int | np.integer):
        raise BadRequestError(f"ctx must be an integer, got {ctx!r}")
    if ctx < 3:
        raise BadRequestError(
            f"ctx must be at least 3, got {ctx}: a window of ctx tokens scores its last "
            "ctx - 1 - ctx // 2 positions"
        )
    if ctx > n_ctx:
        raise BadRequestError(f"ctx {ctx} is longer than the model context ({n_ctx})")
    stride = ctx if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int | np.integer):
        raise BadRequestError(f"stride must be an integer, got {stride!r}")
    if not 1 <= stride <= ctx:
        raise BadRequestError(f"stride must be between 1 and ctx ({ctx}), got {stride}")
    return int(ctx), int(stride)


class _Windows(Sequence[list[int]]):
    """The windows of a tokenized text, made on demand (stride 1 over a long text would
    otherwise hold ctx copies of it)."""

    def __init__(self, ids: Sequence[int], ctx: int, stride: int, bos: int | None) -> None:
        self._ids = np.asarray(ids, dtype=np.int64)
        self._ctx, self._stride, self._bos = ctx, stride, bos
        self._n = (len(self._ids) - ctx) // stride + 1

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._n))]
        if k < 0:
            k += self._n
        if not 0 <= k < self._n:
            raise IndexError(k)
        s = k * self._stride
        w = [int(t) for t in self._ids[s : s + self._ctx]]
        if self._bos is not None:
            w[0] = int(self._bos)
        return w


def perplexity_windows(
    ids: Sequence[int], ctx: int, stride: int, bos: int | None
) -> tuple[Sequence[list[int]], int]:
    """The windows of a tokenized text (a sequence made on demand) and the number of scored
    (last) positions of each (see the module doc); ``bos``: the id that replaces each window's
    first token, or None."""
    n = len(ids)
    if n < ctx:
        raise BadRequestError(
            f"the text has {n} tokens, fewer than one window of ctx={ctx}: give a longer text "
            "or a smaller ctx"
        )
    return _Windows(ids, ctx, stride, bos), min(stride, ctx - 1 - ctx // 2)


def perplexity(
    engine: Any,
    tokenizer: Any,
    text: str,
    *,
    ctx: int | None = None,
    stride: int | None = None,
    progress: Progress | None = None,
) -> PerplexityResult:
    """Perplexity and bits per byte of ``text`` (llama-perplexity's convention: module doc).

    ``ctx`` defaults to `DEFAULT_PPL_CTX` capped by the model context, ``stride`` to ``ctx``;
    ``progress(i, n)`` is called after each window."""
    if not isinstance(text, str) or not text:
        raise BadRequestError("the text is empty")
    n_ctx = int(engine.hp.n_ctx)
    ctx, stride = check_window(min(DEFAULT_PPL_CTX, n_ctx) if ctx is None else ctx, stride, n_ctx)
    ids = encode_context(tokenizer, text)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    windows, n_score = perplexity_windows(ids, ctx, stride, bos)
    runs: list[dict[str, Any]] = []
    s1 = s2 = 0.0
    count = n_bytes = 0
    per_window = []
    for k, (w, logits) in enumerate(zip(windows, _window_logits(engine, windows, runs))):
        toks = np.asarray(w[ctx - n_score :], dtype=np.int64)
        nll = -_row_logprobs(logits[ctx - n_score - 1 : ctx - 1], toks)
        del logits
        s1 += float(nll.sum())
        s2 += float((nll * nll).sum())
        count += int(nll.size)
        n_bytes += sum(len(tokenizer.token_to_bytes(int(t))) for t in toks)
        per_window.append(math.exp(float(nll.mean())))
        if progress is not None:
            progress(k + 1, len(windows))
    m = s1 / count
    var = max(0.0, s2 / count - m * m)
    se = math.sqrt(var / (count - 1)) if count > 1 else None
    nll_est = Estimate(m, se, None if se is None else (m - Z95 * se, m + Z95 * se))
    ppl = math.exp(m)
    ppl_est = Estimate(
        ppl,
        None if se is None else ppl * se,
        None if se is None else (math.exp(m - Z95 * se), math.exp(m + Z95 * se)),
    )
    if n_bytes == 0:
        raise BadRequestError("the scored tokens render to no bytes: bits per byte is undefined")
    per_byte = count / math.log(2) / n_bytes  # d(bpb) / d(mean NLL)
    bpb = m * per_byte
    bpb_se = None if se is None else se * per_byte
    bpb_est = Estimate(
        bpb, bpb_se, None if bpb_se is None else (bpb - Z95 * bpb_se, bpb + Z95 * bpb_se)
    )
    return PerplexityResult(
        perplexity=ppl_est,
        nll=nll_est,
        bits_per_byte=bpb_est,
        ctx=ctx,
        stride=stride,
        n_score=n_score,
        windows=len(windows),
        tokens=len(ids),
        scored_tokens=count,
        scored_bytes=n_bytes,
        bos=bos is not None,
        window_perplexity=tuple(per_window),
        metrics=_merge_metrics(runs),
    )


# -- multiple choice ---------------------------------------------------------------------------
#: The four predictions of a multiple-choice item: the argmax of the choices' log-probability
#: summed, per token, per character of the choice text, per UTF-8 byte of it.
CHOICE_RULES = ("acc", "acc_per_token", "acc_per_char", "acc_per_byte")
_CHOICE_FIELDS = ("context", "choices", "gold", "id")


def _where(where: str | None, msg: str) -> str:
    return f"{where}: {msg}" if where else msg


def _json_item(obj: Any, where: str | None, fields: Sequence[str], required: Sequence[str]) -> None:
    """Check that ``obj`` is a JSON object with only ``fields``, ``required`` among them."""
    if not isinstance(obj, dict):
        raise BadRequestError(_where(where, f"expected a JSON object, got {json_kind(obj)}"))
    for k in obj:
        if k not in fields:
            raise BadRequestError(
                _where(where, f"unknown field {k!r} (expected: {', '.join(fields)})")
            )
    for k in required:
        if k not in obj:
            raise BadRequestError(_where(where, f"missing field {k!r}"))


@attrs.frozen
class ChoiceItem:
    """One multiple-choice question: ``choices[gold]`` is the right continuation of
    ``context``. ``id`` is carried into the details; ``where`` (e.g. ``"F.jsonl:3"``) prefixes
    error messages. Checked when made (`from_dict` is the JSON form of the same check)."""

    context: str
    choices: tuple[str, ...] = attrs.field(converter=tuple)
    gold: int
    id: Any = None
    where: str | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        w = self.where
        if not isinstance(self.context, str):
            raise BadRequestError(_where(w, "'context' must be a string"))
        if len(self.choices) < 2:
            raise BadRequestError(
                _where(w, f"'choices' needs at least two choices, got {len(self.choices)}")
            )
        for i, c in enumerate(self.choices):
            if not isinstance(c, str):
                raise BadRequestError(_where(w, f"choice {i} is {json_kind(c)}, not a string"))
            if not c.strip():
                raise BadRequestError(_where(w, f"choice {i} is empty"))
        g = self.gold
        if isinstance(g, bool) or not isinstance(g, int | np.integer):
            raise BadRequestError(_where(w, f"'gold' must be an integer index, got {json_kind(g)}"))
        if not 0 <= g < len(self.choices):
            raise BadRequestError(
                _where(w, f"gold {g} is out of range: {len(self.choices)} choices (0-based)")
            )

    @classmethod
    def from_dict(cls, obj: Any, where: str | None = None) -> ChoiceItem:
        """An item from its JSON object ``{"context", "choices", "gold", "id"?}``."""
        _json_item(obj, where, _CHOICE_FIELDS, ("context", "choices", "gold"))
        if not isinstance(obj["choices"], list):
            raise BadRequestError(_where(where, "'choices' must be a list of strings"))
        return cls(obj["context"], obj["choices"], obj["gold"], obj.get("id"), where)


@attrs.frozen
class ChoiceResult:
    acc: Estimate
    acc_per_token: Estimate
    acc_per_char: Estimate
    acc_per_byte: Estimate
    correct: dict[str, int]  # items right under each rule
    count: int
    details: tuple[dict[str, Any], ...] = attrs.field(eq=False, repr=False)
    metrics: dict[str, Any] = attrs.field(eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": "choice", "count": self.count}
        for rule in CHOICE_RULES:
            out[rule] = getattr(self, rule).to_dict()
        return out | {"correct": dict(self.correct), "metrics": self.metrics}


def multiple_choice(
    engine: Any,
    tokenizer: Any,
    items: Sequence[ChoiceItem],
    *,
    progress: Progress | None = None,
) -> ChoiceResult:
    """Accuracy over multiple-choice ``items`` (module doc): each item is `tasks.score` of its
    choices after its context — one shared-prefix pass, the choices its branches."""
    items = list(items)
    if not items:
        raise BadRequestError("no items to evaluate")
    correct = dict.fromkeys(CHOICE_RULES, 0)
    details = []
    runs: list[dict[str, Any]] = []
    plans = []
    for k, item in enumerate(items):
        if not isinstance(item, ChoiceItem):
            raise BadRequestError(f"item {k + 1} is {type(item).__name__}, not a ChoiceItem")
        try:
            plans.append(tasks.plan_score(engine, tokenizer, item.context, list(item.choices)))
        except BadRequestError as exc:
            raise BadRequestError(_where(item.where or f"item {k + 1}", str(exc))) from None
    # Many items share each streamed pass (`tasks.run_plans`), in order.
    for k, (item, s) in enumerate(zip(items, tasks.run_plans(engine, plans), strict=True)):
        if isinstance(s, BadRequestError):
            raise BadRequestError(_where(item.where or f"item {k + 1}", str(s))) from None
        if isinstance(s, BaseException):
            raise s
        runs.append(s.metrics)
        scores = {
            "acc": [c.logprob for c in s.choices],
            "acc_per_token": [c.logprob_per_token for c in s.choices],
            "acc_per_char": [c.logprob_per_char for c in s.choices],
            "acc_per_byte": [c.logprob_per_byte for c in s.choices],
        }
        pred = {rule: int(np.argmax(v)) for rule, v in scores.items()}  # ties: lower index
        for rule, p in pred.items():
            correct[rule] += p == item.gold
        key = {"id": item.id} if item.id is not None else {"item": k}
        if item.where:
            key["where"] = item.where
        details.append(
            key
            | {
                "gold": item.gold,
                "pred": pred,
                "correct": {rule: p == item.gold for rule, p in pred.items()},
                "logprob": scores["acc"],
                "n_tokens": [c.n_tokens for c in s.choices],
                "context_tokens": s.context_tokens,
            }
        )
        if progress is not None:
            progress(k + 1, len(items))
    n = len(items)
    est = {rule: proportion(correct[rule], n) for rule in CHOICE_RULES}
    # Each item's metrics list the passes it ran in; items share passes: count each once.
    passes: dict[int, Any] = {}
    for r in runs:
        for p in r["pass"]:
            passes.setdefault(int(p["pass_id"]), p)
    merged = {
        "tokens": sum(int(r["tokens"]) for r in runs),
        "passes": len(passes),
        "pass": list(passes.values()),
    }
    return ChoiceResult(**est, correct=correct, count=n, details=tuple(details), metrics=merged)


# -- cloze -------------------------------------------------------------------------------------
def split_last_word(text: str) -> tuple[str, str]:
    """(context, last word): the word is the last whitespace-separated run of ``text`` (trailing
    whitespace dropped), the context everything before it, its whitespace included."""
    s = text.rstrip()
    i = len(s)
    while i > 0 and not s[i - 1].isspace():
        i -= 1
    return s[:i], s[i:]


@attrs.frozen
class ClozeItem:
    """One passage whose last word is to be predicted; ``id``/``where`` as for `ChoiceItem`."""

    text: str
    id: Any = None
    where: str | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise BadRequestError(_where(self.where, "'text' must be a string"))
        context, word = split_last_word(self.text)
        if not word or not context.strip():
            raise BadRequestError(
                _where(
                    self.where, "the passage needs at least two words (a context and the last word)"
                )
            )

    @classmethod
    def from_dict(cls, obj: Any, where: str | None = None) -> ClozeItem:
        """An item from its JSON object ``{"text", "id"?}``."""
        _json_item(obj, where, ("text", "id"), ("text",))
        return cls(obj["text"], obj.get("id"), where)


@attrs.frozen
class ClozeResult:
    accuracy: Estimate
    word_logprob: Estimate  # mean over passages of log P(last word | context), nats
    word_perplexity: Estimate  # exp(-mean word log-probability)
    count: int
    correct: int
    details: tuple[dict[str, Any], ...] = attrs.field(eq=False, repr=False)
    metrics: dict[str, Any] = attrs.field(eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": "cloze",
            "count": self.count,
            "correct": self.correct,
            "accuracy": self.accuracy.to_dict(),
            "word_logprob": self.word_logprob.to_dict(),
            "word_perplexity": self.word_perplexity.to_dict(),
            "metrics": self.metrics,
        }


def _cloze_tokens(tokenizer: Any, item: ClozeItem, n_ctx: int) -> tuple[list[int], list[int], str]:
    context, word = split_last_word(item.text)
    ctx, cont = tasks.split_context(context, word)
    ids = encode_context(tokenizer, ctx)
    if not ids:
        raise BadRequestError(_where(item.where, "the context tokenizes to nothing"))
    word_ids = tasks.continuation_ids(tokenizer, ctx, cont)
    if not word_ids:
        raise BadRequestError(_where(item.where, f"the last word {word!r} tokenizes to nothing"))
    if len(ids) + len(word_ids) > n_ctx:
        raise BadRequestError(
            _where(
                item.where,
                f"the passage is {len(ids) + len(word_ids)} tokens, longer than the model "
                f"context ({n_ctx})",
            )
        )
    return ids, word_ids, word


def cloze(
    engine: Any,
    tokenizer: Any,
    items: Sequence[ClozeItem],
    *,
    progress: Progress | None = None,
) -> ClozeResult:
    """Last-word accuracy over ``items`` (module doc): one pass over context + word per
    passage, all logits; every passage is tokenized and checked before the first pass."""
    items = list(items)
    if not items:
        raise BadRequestError("no passages to evaluate")
    for k, item in enumerate(items):
        if not isinstance(item, ClozeItem):
            raise BadRequestError(f"item {k + 1} is {type(item).__name__}, not a ClozeItem")
    n_ctx = int(engine.hp.n_ctx)
    toks = [_cloze_tokens(tokenizer, item, n_ctx) for item in items]
    windows = [ids + word_ids for ids, word_ids, _ in toks]
    runs: list[dict[str, Any]] = []
    logps, details = [], []
    correct = 0
    for k, (item, (ids, word_ids, word), logits) in enumerate(
        zip(items, toks, _window_logits(engine, windows, runs))
    ):
        rows = logits[len(ids) - 1 : len(ids) + len(word_ids) - 1]
        want = np.asarray(word_ids, dtype=np.int64)
        hits = rows.argmax(axis=1) == want
        lp = float(_row_logprobs(rows, want).sum())
        del logits, rows
        ok = bool(hits.all())
        correct += ok
        logps.append(lp)
        key = {"id": item.id} if item.id is not None else {"item": k}
        if item.where:
            key["where"] = item.where
        details.append(
            key
            | {
                "word": word,
                "word_tokens": list(word_ids),
                "correct": ok,
                "tokens_right": int(hits.sum()),
                "logprob": lp,
                "context_tokens": len(ids),
            }
        )
        if progress is not None:
            progress(k + 1, len(items))
    n = len(items)
    mean_lp = mean_estimate(logps)
    m, se = mean_lp.value, mean_lp.stderr
    word_ppl = Estimate(
        math.exp(-m),
        None if se is None else math.exp(-m) * se,
        None if se is None else (math.exp(-(m + Z95 * se)), math.exp(-(m - Z95 * se))),
    )
    return ClozeResult(
        accuracy=proportion(correct, n),
        word_logprob=mean_lp,
        word_perplexity=word_ppl,
        count=n,
        correct=correct,
        details=tuple(details),
        metrics=_merge_metrics(runs),
    )
