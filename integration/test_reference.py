"""Self-checks of the float64 reference (integration/reference.py).

The reference is the yardstick for the engine, so it gets its own checks that can fail:
a second, loop-by-loop implementation written separately (including DeepSeek-2 attention in
the absorbed latent form llama.cpp uses), invariances (causality, expert permutation), the
dense-mixture limit of top-k routing, RoPE identities, and file-reading orientation.
"""

from __future__ import annotations

import cmath
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from hypothesis import given
from hypothesis import strategies as st
from reference import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    ReferenceModel,
    UnsupportedModelError,
    moe_ffn,
    reference_forward,
    rope,
    route,
    yarn_corr_dims,
)

ARCHS = ["olmoe", "qwen3moe", "llama", "deepseek2", "lfm2moe", "smallthinker"]
F32 = GGMLQuantizationType.F32
Q4_0 = GGMLQuantizationType.Q4_0
Q8_0 = GGMLQuantizationType.Q8_0


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------------------------------
# A second implementation: token by token, head by head, complex-number RoPE, python routing.
# Written from the architecture definitions, sharing no code with reference.py.
# ------------------------------------------------------------------------------------------


class _Naive:
    def __init__(self, path: Path) -> None:
        self.r = GGUFReader(str(path))
        self.t = {x.name: x for x in self.r.tensors}
        self.f = {k: v.contents() for k, v in self.r.fields.items() if v.types}
        self.arch = self.f["general.architecture"]

    def md(self, key: str, default: object = None) -> object:
        return self.f.get(f"{self.arch}.{key}", default)

    def w(self, name: str) -> np.ndarray | None:
        if name not in self.t:
            return None
        x = self.t[name]
        return dequantize(x.data, x.tensor_type).astype(np.float64).reshape(x.shape[::-1])

    @staticmethod
    def rmsnorm(v: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
        ms = sum(float(e) * float(e) for e in v) / len(v)
        return np.array([float(e) / math.sqrt(ms + eps) for e in v]) * g

    def yarn(self) -> tuple[float, int, float] | None:
        """(factor, original context, log multiplier) when the GGUF asks for YaRN."""
        if self.md("rope.scaling.type") != "yarn" or not float(self.md("rope.scaling.factor", 0)):
            return None
        return (
            float(self.md("rope.scaling.factor")),
            int(self.md("rope.scaling.original_context_length")),
            float(self.md("rope.scaling.yarn_log_multiplier", 0.0)),
        )

    def rope(self, v: np.ndarray, pos: int, n_rot: int, neox: bool) -> np.ndarray:
        """One pair at a time as a complex rotation; under YaRN (from the YaRN paper, as
        llama.cpp's rope_yarn): each pair's angle blends the interpolated (pos/factor) and the
        original angle by a ramp over the pair index between the beta_fast=32 and beta_slow=1
        wavelength limits, and the magnitude is 1 + 0.1·ln(factor), except for DeepSeek-2
        with a log multiplier, whose attention factor cancels it (it moves into kq_scale)."""
        base = float(self.md("rope.freq_base", 10000.0))
        yarn = self.yarn()
        out = v.copy()
        half = n_rot // 2
        for i in range(half):
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            angle, magnitude = pos * base ** (-2.0 * i / n_rot), 1.0
            if yarn is not None:
                factor, n_orig, log_mul = yarn

                def limit(beta: float, n_orig: int = n_orig) -> float:
                    turns = n_orig / (2 * math.pi * beta)
                    return n_rot * math.log(turns) / (2 * math.log(base))

                low = max(0.0, math.floor(limit(32.0)))
                high = min(n_rot - 1.0, math.ceil(limit(1.0)))
                keep = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
                angle = angle / factor * (1.0 - keep) + angle * keep
                if not (self.arch == "deepseek2" and log_mul):
                    magnitude = 1.0 + 0.1 * math.log(factor)
            z = complex(v[a], v[b]) * magnitude * cmath.exp(1j * angle)
            out[a], out[b] = z.real, z.imag
        return out

    def attend(self, qs, ks, vs, scale, window=0, sinks=None):  # type: ignore[no-untyped-def]
        """qs[t][h], ks[s][g], vs[s][g] lists of vectors → per token concatenated heads;
        ``window`` > 0: token t sees the last ``window`` tokens up to itself; ``sinks[h]``: an
        extra score of head h whose value is zero (it only adds to the denominator)."""
        n_head, n_kv = len(qs[0]), len(ks[0])
        out = []
        for t in range(len(qs)):
            heads = []
            first = max(0, t - window + 1) if window else 0
            for h in range(n_head):
                g = h * n_kv // n_head
                sc = [float(qs[t][h] @ ks[s][g]) * scale for s in range(first, t + 1)]
                sink = [] if sinks is None else [float(sinks[h])]
                m = max(sc + sink)
                e = [math.exp(x - m) for x in sc]
                z = sum(e) + sum(math.exp(x - m) for x in sink)
                heads.append(sum(e[s - first] / z * vs[s][g] for s in range(first, t + 1)))
            out.append(np.concatenate(heads))
        return out

    def moe(self, p: str, x: np.ndarray, router_x: np.ndarray | None = None) -> np.ndarray:
        arch = self.arch
        logits = self.w(p + "ffn_gate_inp.weight") @ (x if router_x is None else router_x)
        if arch == "gpt-oss":  # the router's bias, on the logits
            logits = logits + self.w(p + "ffn_gate_inp.bias")
        n_used = int(self.md("expert_used_count"))
        gating = {"olmoe": 1, "qwen3moe": 1, "llama": 1}.get(arch) or int(
            self.md("expert_gating_func", 1) or 1
        )
        if arch == "gpt-oss":  # top-k of the logits, then a softmax over those k
            probs = list(logits)
        elif gating == 1:
            mx = max(logits)
            ex = [math.exp(v - mx) for v in logits]
            probs = [v / sum(ex) for v in ex]
        else:
            probs = [1.0 / (1.0 + math.exp(-v)) for v in logits]
        bias = self.w(p + "exp_probs_b.bias")
        sel = [probs[e] + (0.0 if bias is None else bias[e]) for e in range(len(probs))]
        chosen = sorted(range(len(sel)), key=lambda e: -sel[e])[:n_used]
        wts = [probs[e] for e in chosen]
        if arch == "gpt-oss":
            mx = max(wts)
            wts = [math.exp(v - mx) / sum(math.exp(u - mx) for u in wts) for v in wts]
        normalize = {
            "olmoe": False,
            "qwen3moe": True,
            "llama": True,
            "lfm2moe": True,
            "smallthinker": True,
        }.get(arch, bool(self.md("expert_weights_norm", False)))
        if normalize:
            wts = [v / sum(wts) for v in wts]
        scale = float(self.md("expert_weights_scale", 0.0)) if arch == "deepseek2" else 0.0
        if scale not in (0.0, 1.0):
            wts = [v * scale for v in wts]
        gate = self.w(p + "ffn_gate_exps.weight")
        up = self.w(p + "ffn_up_exps.weight")
        down = self.w(p + "ffn_down_exps.weight")
        y = np.zeros_like(x)
        if arch == "gpt-oss":
            bg, bu, bd = (self.w(p + f"ffn_{j}_exps.bias") for j in ("gate", "up", "down"))
        for e, wt in zip(chosen, wts):
            g = gate[e] @ x
            if arch == "gpt-oss":  # biases, then the clamped SwiGLU of ggml's swiglu_oai
                gs = [min(v, 7.0) for v in g + bg[e]]
                us = [min(max(v, -7.0), 7.0) for v in up[e] @ x + bu[e]]
                h = [a / (1.0 + math.exp(-1.702 * a)) * (b + 1.0) for a, b in zip(gs, us)]
                y = y + wt * (down[e] @ np.asarray(h) + bd[e])
                continue
            act = [max(v, 0.0) for v in g] if arch == "smallthinker" else g / (1 + np.exp(-g))
            y = y + wt * (down[e] @ (np.asarray(act) * (up[e] @ x)))
        if p + "ffn_gate_shexp.weight" in self.t:
            g = self.w(p + "ffn_gate_shexp.weight") @ x
            u = self.w(p + "ffn_up_shexp.weight") @ x
            y = y + self.w(p + "ffn_down_shexp.weight") @ ((g / (1 + np.exp(-g))) * u)
        return y

    def dense(self, p: str, x: np.ndarray) -> np.ndarray:
        g = self.w(p + "ffn_gate.weight") @ x
        return self.w(p + "ffn_down.weight") @ (
            (g / (1 + np.exp(-g))) * (self.w(p + "ffn_up.weight") @ x)
        )

    def forward(self, tokens: list[int]) -> np.ndarray:
        arch = self.arch
        eps = float(self.md("attention.layer_norm_rms_epsilon"))
        emb = self.w("token_embd.weight")
        xs = [emb[tok].copy() for tok in tokens]
        n_head = int(self.md("attention.head_count"))
        kv_md = self.md("attention.head_count_kv")
        for il in range(int(self.md("block_count"))):
            p = f"blk.{il}."
            layer_in = list(xs)  # SmallThinker routes the layer's input
            hs = [self.rmsnorm(x, self.w(p + "attn_norm.weight"), eps) for x in xs]
            if arch == "deepseek2":
                mixed = self.mla_absorbed(p, hs, n_head, eps)
            elif arch == "lfm2moe" and list(kv_md)[il] == 0:
                mixed = self.shortconv(p, hs)
            else:
                n_kv = int(list(kv_md)[il]) if isinstance(kv_md, list) else int(kv_md)
                mixed = self.gqa(p, hs, n_head, n_kv, eps, il)
            xs = [x + m for x, m in zip(xs, mixed)]
            post = "post_attention_norm" if arch == "gpt-oss" else "ffn_norm"
            hs = [self.rmsnorm(x, self.w(p + post + ".weight"), eps) for x in xs]
            if arch == "smallthinker":
                xs = [x + self.moe(p, h, r) for x, h, r in zip(xs, hs, layer_in)]
            else:
                ffn = self.moe if p + "ffn_gate_inp.weight" in self.t else self.dense
                xs = [x + ffn(p, h) for x, h in zip(xs, hs)]
        norm = self.w("token_embd_norm.weight" if arch == "lfm2moe" else "output_norm.weight")
        head = self.w("output.weight")
        head = emb if head is None else head
        return np.stack([head @ self.rmsnorm(x, norm, eps) for x in xs])

    def gqa(self, p, hs, n_head, n_kv, eps, il=0):  # type: ignore[no-untyped-def]
        arch = self.arch
        # SmallThinker with a window (llama.cpp: always 4096 tokens): layers il % pattern slide,
        # layers il % 4 == 0 have no position embedding
        swa = arch == "smallthinker" and int(self.md("attention.sliding_window", 0)) > 0
        window = 4096 if swa and il % int(self.md("attention.sliding_window_pattern", 4)) else 0
        # llama.cpp's graph takes RoPE everywhere when the step (4) equals the layer count
        nope = swa and il % 4 == 0 and int(self.md("block_count")) != 4
        if arch == "gpt-oss":  # the window on the even layers
            window = int(self.md("attention.sliding_window")) if il % 2 == 0 else 0
        wq, wk, wv = (self.w(p + f"attn_{n}.weight") for n in "qkv")
        bq, bk, bv = (self.w(p + f"attn_{n}.bias") for n in "qkv")
        dh = wq.shape[0] // n_head
        n_rot = int(self.md("rope.dimension_count", dh))
        neox = arch != "llama"
        qn, kn = self.w(p + "attn_q_norm.weight"), self.w(p + "attn_k_norm.weight")
        qs, ks, vs = [], [], []
        for pos, h in enumerate(hs):
            q, k, v = wq @ h, wk @ h, wv @ h
            if bq is not None:
                q, k, v = q + bq, k + bk, v + bv
            if arch == "olmoe":
                q, k = self.rmsnorm(q, qn, eps), self.rmsnorm(k, kn, eps)
            qh = [q[i * dh : (i + 1) * dh] for i in range(n_head)]
            kh = [k[i * dh : (i + 1) * dh] for i in range(n_kv)]
            if arch in ("qwen3moe", "lfm2moe"):
                qh = [self.rmsnorm(x, qn, eps) for x in qh]
                kh = [self.rmsnorm(x, kn, eps) for x in kh]
            qs.append([x if nope else self.rope(x, pos, n_rot, neox) for x in qh])
            ks.append([x if nope else self.rope(x, pos, n_rot, neox) for x in kh])
            vs.append([v[i * dh : (i + 1) * dh] for i in range(n_kv)])
        wo, bo = self.w(p + "attn_output.weight"), self.w(p + "attn_output.bias")
        sinks = self.w(p + "attn_sinks.weight")
        outs = self.attend(qs, ks, vs, 1 / math.sqrt(dh), window, sinks)
        return [wo @ o + (0.0 if bo is None else bo) for o in outs]

    def mla_absorbed(self, p, hs, n_head, eps):  # type: ignore[no-untyped-def]
        """DeepSeek-2 attention in the latent (absorbed) form: scores against the latent."""
        rank = int(self.md("attention.kv_lora_rank"))
        d_rope = int(self.md("rope.dimension_count"))
        dk = int(self.md("attention.key_length_mla"))
        d_nope = dk - d_rope
        wq = self.w(p + "attn_q.weight")
        if wq is None:  # low-rank q: q = W_qb · rmsnorm(W_qa · h)
            wqa, wqb = self.w(p + "attn_q_a.weight"), self.w(p + "attn_q_b.weight")
            qa_norm = self.w(p + "attn_q_a_norm.weight")
        wkv_a = self.w(p + "attn_kv_a_mqa.weight")
        k_b = self.w(p + "attn_k_b.weight")  # [H, rank, d_nope]
        v_b = self.w(p + "attn_v_b.weight")  # [H, dv, rank]
        qs, ks, vs = [], [], []
        for pos, h in enumerate(hs):
            q = wq @ h if wq is not None else wqb @ self.rmsnorm(wqa @ h, qa_norm, eps)
            q = q.reshape(n_head, dk)
            a = wkv_a @ h
            lat = self.rmsnorm(a[:rank], self.w(p + "attn_kv_a_norm.weight"), eps)
            k_pe = self.rope(a[rank:], pos, d_rope, neox=False)
            qs.append(
                [
                    np.concatenate(
                        [k_b[i] @ q[i, :d_nope], self.rope(q[i, d_nope:], pos, d_rope, False)]
                    )
                    for i in range(n_head)
                ]
            )
            ks.append([np.concatenate([lat, k_pe])])
            vs.append([lat])
        scale = 1 / math.sqrt(dk)
        yarn = self.yarn()
        if yarn is not None:  # DeepSeek-2: the YaRN magnitude squared, on the scores
            factor, _, log_mul = yarn
            scale *= (1.0 + log_mul * math.log(factor)) ** 2
        outs = self.attend(qs, ks, vs, scale)
        wo = self.w(p + "attn_output.weight")
        return [
            wo @ np.concatenate([v_b[i] @ o.reshape(n_head, rank)[i] for i in range(n_head)])
            for o in outs
        ]

    def shortconv(self, p, hs):  # type: ignore[no-untyped-def]
        w_in = self.w(p + "shortconv.in_proj.weight")
        kern = self.w(p + "shortconv.conv.weight")  # [d, L]
        d, length = kern.shape
        bcx = [w_in @ h for h in hs]
        bx = [v[:d] * v[2 * d :] for v in bcx]
        out = []
        for t in range(len(hs)):
            acc = np.zeros(d)
            for j in range(length):
                s = t - (length - 1) + j
                if s >= 0:
                    acc = acc + kern[:, j] * bx[s]
            out.append(self.w(p + "shortconv.out_proj.weight") @ (bcx[t][d : 2 * d] * acc))
        return out


@pytest.mark.parametrize("qtype", [F32, Q4_0], ids=["f32", "q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_reference_matches_loop_implementation(tiny_gguf, arch: str, qtype) -> None:  # type: ignore[no-untyped-def]
    path = tiny_gguf(arch, qtype, seed=11, n_layer=3 if arch in ("deepseek2", "lfm2moe") else 2)
    tokens = [1, 17, 4, 4, 90, 33, 2, 61]
    got = reference_forward(path, tokens)
    want = _Naive(path).forward(tokens)
    assert got.shape == want.shape == (len(tokens), 96)
    assert rel_l2(got, want) < 1e-12


@pytest.mark.parametrize(
    "arch", ["olmoe", "qwen3moe", "mixtral", "deepseek2", "lfm2moe", "smallthinker", "gpt-oss"]
)
def test_reference_matches_loop_implementation_on_synthetic_models(
    tmp_path: Path, arch: str
) -> None:
    """The layout package's synthetic GGUFs (tiny preset, their default expert type): same two
    implementations (gpt-oss: 13 tokens, past its 8-token window)."""
    from estream_layout import synth_model

    path = synth_model(arch, "tiny", tmp_path / f"{arch}.gguf", seed=7)
    model = ReferenceModel(path)
    n = 13 if arch == "gpt-oss" else 7
    tokens = np.random.default_rng(1).integers(0, model.config.n_vocab, n).tolist()
    got = model.forward(tokens)
    want = _Naive(path).forward(tokens)
    assert got.shape == want.shape == (n, model.config.n_vocab)
    assert rel_l2(got, want) < 1e-12


# ------------------------------------------------------------------------------------------
# Invariances
# ------------------------------------------------------------------------------------------


@given(
    arch=st.sampled_from(ARCHS),
    data=st.data(),
)
def test_causal(tiny_gguf, arch: str, data) -> None:  # type: ignore[no-untyped-def]
    path = tiny_gguf(arch, Q4_0, seed=5)
    n = data.draw(st.integers(2, 12), label="T")
    cut = data.draw(st.integers(1, n - 1), label="cut")
    tokens = data.draw(st.lists(st.integers(0, 95), min_size=n, max_size=n), label="tokens")
    tail = data.draw(st.lists(st.integers(0, 95), min_size=n - cut, max_size=n - cut))
    model = ReferenceModel(path)
    a = model.forward(tokens)
    b = model.forward(tokens[:cut] + tail)
    # Equal up to float64 rounding (BLAS blocking depends on T); a leak would be >> 1e-12.
    np.testing.assert_allclose(a[:cut], b[:cut], rtol=1e-12, atol=1e-12)
    prefix = model.forward(tokens[:cut])
    np.testing.assert_allclose(prefix, a[:cut], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_later_positions_see_earlier_tokens(tiny_gguf, arch: str) -> None:  # type: ignore[no-untyped-def]
    """Guards the causality test against a model that ignores context altogether."""
    model = ReferenceModel(tiny_gguf(arch, Q4_0, seed=5))
    a = model.forward([5, 6, 7, 8])
    b = model.forward([9, 6, 7, 8])
    assert np.all(np.abs(a[1:] - b[1:]).max(axis=1) > 1e-6)


@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 2**16))
def test_permuting_experts_with_router_rows_changes_nothing(
    tiny_model, tiny_gguf_dir: Path, arch: str, seed: int
) -> None:  # type: ignore[no-untyped-def]
    base = tiny_model(arch, seed=3)
    perm_model = base.copy()
    rng = np.random.default_rng(seed)
    for il in range(base.n_layer):
        p = f"blk.{il}."
        if p + "ffn_gate_inp.weight" not in base.tensors:
            continue
        perm = rng.permutation(base.tensors[p + "ffn_gate_inp.weight"].shape[0])
        for name in (
            "ffn_gate_inp.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
            "exp_probs_b.bias",
        ):
            if p + name in base.tensors:
                perm_model.tensors[p + name] = base.tensors[p + name][perm]
    a_path = base.write(tiny_gguf_dir / f"perm-a-{arch}.gguf", Q8_0)
    b_path = perm_model.write(tiny_gguf_dir / f"perm-b-{arch}.gguf", Q8_0)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_allclose(
        reference_forward(a_path, tokens), reference_forward(b_path, tokens), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_permuting_experts_alone_changes_logits(tiny_model, tiny_gguf_dir: Path, arch: str) -> None:  # type: ignore[no-untyped-def]
    """Guards the permutation test: moving experts without their router rows must matter."""
    base = tiny_model(arch, seed=3)
    moved = base.copy()
    perm = np.roll(np.arange(8), 1)
    moved.tensors["blk.0.ffn_down_exps.weight"] = base.tensors["blk.0.ffn_down_exps.weight"][perm]
    tokens = [3, 1, 4, 1, 5]
    a = reference_forward(base.write(tiny_gguf_dir / f"mv-a-{arch}.gguf"), tokens)
    b = reference_forward(moved.write(tiny_gguf_dir / f"mv-b-{arch}.gguf"), tokens)
    assert rel_l2(a, b) > 1e-3


def test_mla_split_and_fused_forms_agree(mla_pair, tiny_gguf_dir: Path) -> None:  # type: ignore[no-untyped-def]
    fused, split = mla_pair(21)
    tokens = [7, 3, 3, 50, 1, 12]
    a = reference_forward(fused.write(tiny_gguf_dir / "mla-fused.gguf"), tokens)
    b = reference_forward(split.write(tiny_gguf_dir / "mla-split.gguf"), tokens)
    assert rel_l2(a, b) < 1e-12


# ------------------------------------------------------------------------------------------
# Routing and expert mixture
# ------------------------------------------------------------------------------------------


@given(
    n_tokens=st.integers(1, 9),
    n_expert=st.integers(2, 12),
    normalize=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_topk_of_all_experts_is_the_dense_mixture(n_tokens, n_expert, normalize, seed) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    d, ff = 7, 5
    x = rng.standard_normal((n_tokens, d))
    gate = rng.standard_normal((n_expert, ff, d))
    up = rng.standard_normal((n_expert, ff, d))
    down = rng.standard_normal((n_expert, d, ff))
    logits = rng.standard_normal((n_tokens, n_expert))
    experts, weights = route(
        logits, n_expert, gating=GATING_SOFTMAX, normalize=normalize, scale=1.0
    )
    got = moe_ffn(x, experts, weights, gate, up, down)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    g = np.einsum("efd,td->tef", gate, x)
    u = np.einsum("efd,td->tef", up, x)
    y = np.einsum("edf,tef->ted", down, g / (1 + np.exp(-g)) * u)
    want = np.einsum("te,ted->td", p, y)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@given(
    n_expert=st.integers(4, 16),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    gating=st.sampled_from([GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT]),
    normalize=st.booleans(),
    scale=st.sampled_from([0.0, 1.0, 2.5]),
    biased=st.booleans(),
)
def test_route_follows_the_definition(n_expert, k, seed, gating, normalize, scale, biased) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((5, n_expert)) * 2
    bias = rng.standard_normal(n_expert) if biased else None
    experts, weights = route(
        logits, k, gating=gating, normalize=normalize, scale=scale, selection_bias=bias
    )
    for t in range(5):
        row = logits[t]
        if gating == GATING_SOFTMAX:
            probs = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
        elif gating == GATING_SIGMOID:
            probs = [1 / (1 + math.exp(-v)) for v in row]
        else:
            probs = list(row)
        sel = [probs[e] + (bias[e] if bias is not None else 0.0) for e in range(n_expert)]
        chosen = sorted(range(n_expert), key=lambda e: -sel[e])[:k]
        w = [probs[e] for e in chosen]
        if gating == GATING_SOFTMAX_WEIGHT:
            w = [math.exp(v) / sum(math.exp(u) for u in w) for v in w]
        if normalize:
            w = [v / sum(w) for v in w]
        if scale not in (0.0, 1.0):
            w = [v * scale for v in w]
        assert list(experts[t]) == chosen
        np.testing.assert_allclose(weights[t], w, rtol=1e-12)


def test_group_limited_routing_only_picks_from_the_best_groups() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((40, 16))
    experts, _ = route(
        logits, 3, gating=GATING_SIGMOID, normalize=True, scale=1.0, n_groups=4, n_groups_used=2
    )
    probs = 1 / (1 + np.exp(-logits))
    for t in range(40):
        groups = probs[t].reshape(4, 4)
        score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
        best = set(np.argsort(-score)[:2])
        assert {e // 4 for e in experts[t]} <= best
        allowed = [e for e in range(16) if e // 4 in best]
        assert list(experts[t]) == sorted(allowed, key=lambda e: -probs[t, e])[:3]


# ------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------


@given(
    style=st.sampled_from(["norm", "neox"]),
    half=st.integers(1, 8),
    extra=st.integers(0, 3),
    m=st.integers(0, 300),
    n=st.integers(0, 300),
    shift=st.integers(0, 300),
    seed=st.integers(0, 2**16),
)
def test_rope_is_a_rotation_by_relative_position(style, half, extra, m, n, shift, seed) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    n_rot = 2 * half
    q = rng.standard_normal((1, 1, n_rot + 2 * extra))
    k = rng.standard_normal((1, 1, n_rot + 2 * extra))
    kw = dict(n_rot=n_rot, style=style, freq_base=10000.0)

    def dot(a: int, b: int) -> float:
        return float(rope(q, np.array([a]), **kw).ravel() @ rope(k, np.array([b]), **kw).ravel())

    np.testing.assert_allclose(dot(m, n), dot(m + shift, n + shift), rtol=1e-9, atol=1e-9)
    r = rope(q, np.array([m]), **kw)
    np.testing.assert_allclose(np.linalg.norm(r), np.linalg.norm(q), rtol=1e-12)
    np.testing.assert_array_equal(r[..., n_rot:], q[..., n_rot:])


@given(half=st.integers(1, 8), pos=st.integers(0, 500), seed=st.integers(0, 2**16))
def test_norm_rope_is_neox_rope_on_interleaved_dims(half, pos, seed) -> None:  # type: ignore[no-untyped-def]
    """Adjacent-pair RoPE equals NeoX RoPE after de-interleaving — the converter's permutation."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 1, 2 * half))
    order = np.concatenate([np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)])
    kw = dict(n_rot=2 * half, freq_base=500.0)
    normal = rope(x, np.array([pos]), style="norm", **kw)
    neox = rope(x[..., order], np.array([pos]), style="neox", **kw)
    np.testing.assert_allclose(normal[..., order], neox, rtol=1e-12, atol=1e-12)
    if half > 1 and pos > 0:
        assert not np.allclose(rope(x, np.array([pos]), style="neox", **kw), normal)


@given(
    half=st.integers(4, 32),
    factor=st.sampled_from([2.0, 4.0, 40.0]),
    pos=st.integers(1, 5000),
    seed=st.integers(0, 2**16),
)
def test_yarn_keeps_fast_pairs_and_interpolates_slow_pairs(half, factor, pos, seed) -> None:  # type: ignore[no-untyped-def]
    """YaRN: pairs below the ramp turn by the unscaled angle, pairs above by angle/factor."""
    n_rot = 2 * half
    low, high = yarn_corr_dims(n_rot, 64, 10000.0)
    kw = dict(n_rot=n_rot, style="neox", freq_base=10000.0, freq_scale=1 / factor)
    x = np.random.default_rng(seed).standard_normal((1, 1, n_rot))
    mscale = 1.0 + 0.1 * math.log(factor)
    yarn = rope(x, np.array([pos]), ext_factor=1.0, corr_dims=(low, high), **kw) / mscale
    plain = rope(x, np.array([pos]), **{**kw, "freq_scale": 1.0})
    scaled = rope(x, np.array([pos]), **kw)
    for i in range(half):
        pair = [i, i + half]
        if i <= low:
            np.testing.assert_allclose(yarn[..., pair], plain[..., pair], rtol=1e-9, atol=1e-9)
        elif i >= high:
            np.testing.assert_allclose(yarn[..., pair], scaled[..., pair], rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------
# Reading the GGUF
# ------------------------------------------------------------------------------------------


def test_tensors_are_read_in_numpy_order(tiny_model, tiny_gguf_dir: Path) -> None:  # type: ignore[no-untyped-def]
    m = tiny_model("qwen3moe", seed=9)
    model = ReferenceModel(m.write(tiny_gguf_dir / "orient.gguf"))
    for name in ("blk.1.ffn_down_exps.weight", "blk.0.attn_q.weight", "token_embd.weight"):
        np.testing.assert_array_equal(model.tensor(name), m.tensors[name].astype(np.float64))


@pytest.mark.parametrize("chunk_rows", [1, 7, 95, 96, 4096])
def test_output_head_in_row_blocks_is_the_full_product(tiny_gguf, chunk_rows: int) -> None:  # type: ignore[no-untyped-def]
    model = ReferenceModel(tiny_gguf("olmoe", Q4_0, seed=6))
    hidden = np.random.default_rng(0).standard_normal((5, 64))
    want = hidden @ model.tensor("output.weight").T
    got = model._head(hidden, "output.weight", chunk_rows=chunk_rows)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_tied_head_uses_token_embd(tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    path = tiny_gguf("llama", Q4_0, seed=2)
    model = ReferenceModel(path)
    assert not model.has("output.weight")
    logits, hidden = model.forward([4, 8, 15], return_hidden=True)
    np.testing.assert_allclose(logits, hidden @ model.tensor("token_embd.weight").T, rtol=1e-12)
    assert hidden.shape == (3, 64)


def test_quantized_model_is_close_to_but_not_the_float_model(tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    tokens = [1, 2, 3, 4, 5, 6]
    a = reference_forward(tiny_gguf("qwen3moe", F32, seed=4), tokens)
    b = reference_forward(tiny_gguf("qwen3moe", Q8_0, seed=4), tokens)
    assert 0 < rel_l2(b, a) < 0.05


def test_refuses_what_it_does_not_implement(tiny_model, tiny_gguf_dir: Path) -> None:  # type: ignore[no-untyped-def]
    m = tiny_model("qwen3moe", seed=1)
    m.metadata["qwen3moe.rope.scaling.type"] = "longrope"
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ReferenceModel(m.write(tiny_gguf_dir / "longrope.gguf"))
    m = tiny_model("lfm2moe", seed=1)
    m.metadata["lfm2moe.attention.sliding_window"] = 16
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        ReferenceModel(m.write(tiny_gguf_dir / "swa.gguf"))
    model = ReferenceModel(tiny_model("olmoe").write(tiny_gguf_dir / "ok.gguf"))
    with pytest.raises(ValueError, match="token ids"):
        model.forward([0, 96])


def test_reference_smallthinker_softmax_without_window(tmp_path: Path) -> None:
    """SmallThinker's other form (softmax router, no sliding window: RoPE on every layer, the
    synth `small` preset on a generated vocabulary): both implementations agree."""
    from estream_layout import synth_model

    path = synth_model("smallthinker", "small", tmp_path / "s.gguf", seed=3, vocab="-")
    model = ReferenceModel(path)
    assert model.config.gating == 1 and model.config.nope_layers == ()
    tokens = np.random.default_rng(2).integers(0, model.config.n_vocab, 5).tolist()
    assert rel_l2(model.forward(tokens), _Naive(path).forward(tokens)) < 1e-12


def test_sliding_window_attention_matches_the_loop() -> None:
    """The reference's sliding-window mask (each query sees the last `window` positions up to
    itself) against the loop implementation's, with a window shorter than the sequence."""
    from reference import causal_attention

    rng = np.random.default_rng(0)
    t, h, g, d = 9, 4, 2, 8
    q, k, v = (
        rng.standard_normal((t, h, d)),
        rng.standard_normal((t, g, d)),
        rng.standard_normal((t, g, d)),
    )
    naive = _Naive.__new__(_Naive)
    for window in (1, 3, 9):
        got = causal_attention(q, k, v, 0.3, window)
        want = np.stack(naive.attend(list(q), list(k), list(v), 0.3, window))
        assert rel_l2(got, want) < 1e-12
    assert rel_l2(causal_attention(q, k, v, 0.3, 3), causal_attention(q, k, v, 0.3)) > 1e-3
