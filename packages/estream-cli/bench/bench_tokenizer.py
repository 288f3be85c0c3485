"""Tokenization speed (tokens/s) of estream's GGUF tokenizer, next to HuggingFace ``tokenizers``
and llama.cpp itself (through llama-cpp-python) when they are installed.

For every vocabulary shipped in estream-layout (``estream_layout/data/``) the same text (llama.cpp's test strings repeated
plus seeded synthetic prose, ``--kb`` KiB) is tokenized by:

* ``estream cold``: our tokenizer with an empty word cache (first pass over the text);
* ``estream warm``: the same instance again (BPE results cached per word);
* ``hf``: a ``tokenizers.Tokenizer`` built from the same GGUF vocabulary. For BPE vocabs: a BPE
  model with the GGUF merges, the model's split regex(es) and the byte-level step, user-defined
  tokens added as added tokens. For the SentencePiece vocab: a BPE model with merges derived
  from the piece scores and byte fallback, as HF converts Llama tokenizers. HF runs compiled
  Rust; it is an *equivalent* pipeline, not the same code, and we report whether its ids agree
  with ours on the benchmark text;
* ``llama.cpp``: ``llama_tokenize`` of llama-cpp-python (the reference implementation).

Each figure is the best of ``--repeat`` runs. Prints a table and writes
``bench-results/bench_tokenizer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from estream.tokenizer import TokenAttr, Tokenizer, _pretok, read_tokenizer_metadata
from estream.tokenizer.testing import (
    find_vocab_dir,
    read_vocab_tests,
    vocab_files,
)

# The split regexes of each pre-tokenizer in HF syntax (the models' tokenizer.json).
_HF_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_HF_SPLITS: dict[str, list[str]] = {
    "qwen2": [
        _HF_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    # Python-regex syntax of our own table works for HF's Oniguruma too (bar "\Z" -> "$")
    "deepseek-llm": [p.replace(r"\Z", "$") for p in _pretok._DEEPSEEK_LLM],
}

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "that",
    "with",
    "as",
    "on",
    "by",
    "be",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "which",
    "it",
    "not",
    "have",
    "has",
    "had",
    "were",
    "their",
    "more",
    "model",
    "expert",
    "layer",
    "token",
    "prefill",
    "memory",
    "stream",
    "weight",
    "routing",
    "bandwidth",
    "compute",
    "latency",
    "phone",
    "battery",
    "kernel",
    "matrix",
    "vector",
    "quantized",
    "block",
    "scale",
    "cache",
    "arena",
    "residency",
    "slot",
    "bank",
    "group",
    "plane",
    "route",
    "schedule",
    "pipeline",
    "overlap",
    "Mixture",
    "Experts",
    "Qwen",
    "OLMoE",
    "DeepSeek",
    "Snapdragon",
    "Hexagon",
    "tensor",
    "GGUF",
    "llama.cpp",
]


def build_corpus(vocab_dir: Path, kib: int, seed: int = 0) -> str:
    """llama.cpp's test strings repeated (a third) plus seeded synthetic prose."""
    samples = [t for p in vocab_files(vocab_dir)[:1] for t, _ in read_vocab_tests(p)]
    block = "\n".join(samples)
    target = kib * 1024
    parts = [block] * max(1, (target // 3) // max(1, len(block.encode())))
    rng = random.Random(seed)
    size = sum(len(p.encode()) for p in parts)
    while size < target:
        n = rng.randint(6, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(n), str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.insert(rng.randrange(n), rng.choice(["don't", "it's", "we'll", "they're"]))
        sentence = " ".join(words).capitalize() + rng.choice([". ", ", ", "! ", "? ", ".\n"])
        parts.append(sentence)
        size += len(sentence.encode())
    return "".join(parts)


def build_unique_corpus(kib: int, seed: int = 1) -> str:
    """Mostly never-repeating words (random syllables, some Cyrillic/CJK/digits): what a word
    cache cannot help with."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "nu", "pre", "str", "ex", "qua", "zo", "th", "ing", "ed", "ion"]
    extra = ["нещо", "Български", "我想在", "工作", "Cửa", "Việt", "Äpfel"]
    out: list[str] = []
    size, target = 0, kib * 1024
    while size < target:
        r = rng.random()
        if r < 0.06:
            word = rng.choice(extra) + rng.choice(syll)
        elif r < 0.12:
            word = str(rng.randint(0, 10**8))
        else:
            word = "".join(rng.choice(syll) for _ in range(rng.randint(2, 5)))
            if rng.random() < 0.2:
                word = word.capitalize()
        word += rng.choice([" ", " ", " ", " ", ", ", ". ", "\n", "  "])
        out.append(word)
        size += len(word.encode())
    return "".join(out)


def best_of(repeat: int, fn: Any) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def hf_tokenizer(path: Path, tok: Tokenizer) -> Any:
    """An equivalent ``tokenizers`` pipeline for the GGUF vocabulary (see module docs)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    meta = read_tokenizer_metadata(path)
    texts: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(texts)}
    if tok.model == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        steps = [
            pre_tokenizers.Split(Regex(rx), behavior="isolated")
            for rx in _HF_SPLITS.get(tok.pre, [])
        ]
        use_regex = tok.pre not in _HF_SPLITS  # GPT-2's own regex otherwise
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex))
        hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
        hf.decoder = decoders.ByteLevel()
    else:
        scores = meta["tokenizer.ggml.scores"]
        types = meta["tokenizer.ggml.token_type"]
        normal = [i for i, t in enumerate(types) if t == 1]
        merges_scored = []
        for i in normal:
            piece = texts[i]
            for cut in range(1, len(piece)):
                a, b = piece[:cut], piece[cut:]
                if a in vocab and b in vocab:
                    merges_scored.append((-float(scores[i]), vocab[a], vocab[b], a, b))
        merges_scored.sort()
        merges = [(a, b) for _, _, _, a, b in merges_scored]
        hf = HFTokenizer(
            models.BPE(
                vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token="<unk>"
            )
        )
        hf.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    user = [
        AddedToken(t, normalized=False, special=False)
        for i, t in enumerate(texts)
        if tok.token_attr(i) & TokenAttr.USER_DEFINED
    ]
    if user:
        hf.add_tokens(user)
    return hf


def llama_cpp_tokenize(path: Path) -> Any:
    """A function text -> ids through llama.cpp, or None if llama-cpp-python is missing."""
    try:
        import ctypes

        import llama_cpp
    except ImportError:
        return None
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None
    vocab = llama_cpp.llama_model_get_vocab(model)

    def tokenize(text: str) -> list[int]:
        data = text.encode()
        n_max = len(data) + 16
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, False, False)
        return list(buf[:n])

    del ctypes
    tokenize.model = model  # type: ignore[attr-defined]  # keep the model alive
    return tokenize


def measure(
    name: str,
    cname: str,
    corpus: str,
    tok: Tokenizer,
    t_load: float,
    hf: Any,
    lcpp: Any,
    repeat: int,
) -> dict[str, Any]:
    """One table row: every tokenizer on one text."""

    def cold() -> list[int]:
        tok.clear_caches()
        return tok.encode(corpus)

    t_cold, ids = best_of(repeat, cold)
    t_warm, _ = best_of(repeat, lambda: tok.encode(corpus))
    row: dict[str, Any] = {
        "vocab": name,
        "corpus": cname,
        "model": tok.model,
        "pre": tok.pre,
        "text_bytes": len(corpus.encode()),
        "tokens": len(ids),
        "load_s": t_load,
        "estream_cold_tok_s": len(ids) / t_cold,
        "estream_warm_tok_s": len(ids) / t_warm,
    }
    if hf is not None:
        t_hf, enc = best_of(repeat, lambda: hf.encode(corpus, add_special_tokens=False))
        row["hf_tok_s"] = len(enc.ids) / t_hf
        row["hf_agrees"] = enc.ids == ids
        row["hf_first_diff"] = first_diff(enc.ids, ids)
        row["estream_cold_vs_hf"] = row["estream_cold_tok_s"] / row["hf_tok_s"]
    if lcpp is not None:
        t_l, lids = best_of(repeat, lambda: lcpp(corpus))
        row["llama_cpp_tok_s"] = len(lids) / t_l
        row["llama_cpp_agrees"] = lids == ids
        row["estream_cold_vs_llama_cpp"] = row["estream_cold_tok_s"] / row["llama_cpp_tok_s"]
    return row


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kb", type=int, default=300, help="text size in KiB (default 300)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure, best kept")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    args = ap.parse_args()

    vocab_dir = find_vocab_dir()
    if not vocab_files(vocab_dir):
        print(f"no ggml-vocab-*.gguf in {vocab_dir}", file=sys.stderr)
        return 2
    corpora = {
        "mixed": build_corpus(vocab_dir, args.kb),
        "unique": build_unique_corpus(args.kb),
    }
    try:
        import tokenizers

        hf_version: str | None = tokenizers.__version__
    except ImportError:
        hf_version = None
        print("note: HuggingFace 'tokenizers' is not installed: no hf column", file=sys.stderr)

    rows: list[dict[str, Any]] = []
    for path in vocab_files(vocab_dir):
        name = path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        t_load, tok = best_of(1, lambda p=path: Tokenizer.from_gguf(p))
        hf = hf_tokenizer(path, tok) if hf_version is not None else None
        lcpp = llama_cpp_tokenize(path)
        for cname, corpus in corpora.items():
            rows.append(measure(name, cname, corpus, tok, t_load, hf, lcpp, args.repeat))

    def fmt(v: Any, spec: str) -> str:
        if isinstance(v, bool):
            v = "yes" if v else "NO"
        return "-" if v is None else format(v, spec)

    head = (
        f"{'vocab':<13} {'text':<7} {'tokens':>7} {'est cold':>10} {'est warm':>10} {'hf':>10} "
        f"{'llama.cpp':>10} {'cold/hf':>7} {'cold/l.cpp':>10} {'hf=':>4} {'l.cpp=':>6}"
    )
    print(f"texts: {args.kb} KiB each; tokens/s, best of {args.repeat}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['vocab']:<13} {r['corpus']:<7} {r['tokens']:>7} {r['estream_cold_tok_s']:>10,.0f} "
            f"{r['estream_warm_tok_s']:>10,.0f} {fmt(r.get('hf_tok_s'), '>10,.0f')} "
            f"{fmt(r.get('llama_cpp_tok_s'), '>10,.0f')} "
            f"{fmt(r.get('estream_cold_vs_hf'), '>7.3f')} "
            f"{fmt(r.get('estream_cold_vs_llama_cpp'), '>10.3f')} "
            f"{fmt(r.get('hf_agrees'), '>4')} {fmt(r.get('llama_cpp_agrees'), '>6')}"
        )
    root = next(
        (p for p in Path(__file__).resolve().parents if (p / "noxfile.py").is_file()), Path.cwd()
    )
    out = args.out or root / "bench-results" / "bench_tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "tokenizer",
                "python": platform.python_version(),
                "machine": platform.machine(),
                "tokenizers": hf_version,
                "text_kib": args.kb,
                "repeat": args.repeat,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
