"""The vocabulary family records are written in: a synthetic model's tensor plan, and the
per-layer tensor checks that packing and loading share.

A family module describes its layers with the helpers here (`Plan` for what the synthesizer
writes, `Want` for what a file must hold) so that the tensor names and shapes of one family are
written down once, in its own module, in llama.cpp's naming.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

__all__ = ["Plan", "PlannedTensor", "Want"]

F32 = GGMLQuantizationType.F32


@attrs.frozen
class PlannedTensor:
    """One tensor a synthetic model gets: its name, numpy-order shape, type and how its values
    are drawn (`kind`: "matrix" | "norm" | "router" | "conv" | "bias" | "embed")."""

    name: str
    shape: tuple[int, ...]  # numpy order
    qtype: GGMLQuantizationType
    kind: str
    gain: float = 1.0

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * (self.shape[-1] // block) * size


class Plan:
    """A synthetic model's tensors in file order, appended by a family's ``synth_layer``.

    ``d`` is the preset's `SynthDims`; the types are those `synth_model` was asked for."""

    def __init__(
        self,
        d: Any,
        n_vocab: int,
        expert_type: GGMLQuantizationType,
        dense_type: GGMLQuantizationType,
        output_type: GGMLQuantizationType,
        down_type: GGMLQuantizationType | None,
    ) -> None:
        self.d, self.n_vocab = d, n_vocab
        self.expert_type, self.dense_type, self.output_type = expert_type, dense_type, output_type
        self.down_type = down_type or expert_type
        self.tensors: list[PlannedTensor] = []

    def add(
        self, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, kind: str,
        gain: float = 1.0,
    ) -> None:  # fmt: skip
        self.tensors.append(PlannedTensor(name, shape, qtype, kind, gain))

    def matrix(self, name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        """A dense weight `[rows, cols]` of the dense type."""
        self.add(name, (rows, cols), self.dense_type, "matrix", gain)

    def norm(self, name: str, n: int) -> None:
        """An f32 RMSNorm weight of `n` entries near 1."""
        self.add(name, (n,), F32, "norm")

    def head(self, final_norm: str, tied: bool) -> None:
        """The token embedding, the final norm and (unless ``tied``) the output projection."""
        ne = self.d.n_embd
        self.add("token_embd.weight", (self.n_vocab, ne), self.dense_type, "embed")
        self.norm(final_norm, ne)
        if not tied:
            self.add("output.weight", (self.n_vocab, ne), self.output_type, "matrix")

    def router(self, i: int) -> None:
        d = self.d
        self.add(f"blk.{i}.ffn_gate_inp.weight", (d.n_experts, d.n_embd), F32, "router")

    def expert_stacks(self, i: int) -> None:
        """The stacked routed experts `ffn_{gate,up,down}_exps` `[E, rows, cols]`."""
        d = self.d
        e, ne, ff = d.n_experts, d.n_embd, d.n_ff_exp
        self.add(f"blk.{i}.ffn_gate_exps.weight", (e, ff, ne), self.expert_type, "matrix")
        self.add(f"blk.{i}.ffn_up_exps.weight", (e, ff, ne), self.expert_type, "matrix")
        self.add(f"blk.{i}.ffn_down_exps.weight", (e, ne, ff), self.down_type, "matrix", 0.5)

    def experts(self, i: int) -> None:
        """The router `ffn_gate_inp` then the expert stacks."""
        self.router(i)
        self.expert_stacks(i)

    def dense_ffn(self, i: int, width: int, tag: str = "") -> None:
        """A dense gated FFN `ffn_{gate,up,down}{tag}` of `width`."""
        ne = self.d.n_embd
        self.matrix(f"blk.{i}.ffn_gate{tag}.weight", width, ne)
        self.matrix(f"blk.{i}.ffn_up{tag}.weight", width, ne)
        self.matrix(f"blk.{i}.ffn_down{tag}.weight", ne, width, 0.5)

    def attention(self, i: int, out_gain: float) -> None:
        """`attn_{q,k,v,output}` of grouped-query attention."""
        d, p = self.d, f"blk.{i}."
        hd, nh, nkv, ne = d.head_dim, d.n_head, d.n_head_kv, d.n_embd
        self.matrix(p + "attn_q.weight", nh * hd, ne)
        self.matrix(p + "attn_k.weight", nkv * hd, ne)
        self.matrix(p + "attn_v.weight", nkv * hd, ne)
        self.matrix(p + "attn_output.weight", ne, nh * hd, out_gain)


class Want:
    """The non-expert tensors a model must hold (name -> numpy shape), with the optional ones
    whose shape is checked when present; filled by a family's ``layer_tensors``."""

    def __init__(self, spec: Any, shapes: Any) -> None:
        self.spec, self.shapes = spec, shapes
        self.required: dict[str, tuple[int, ...]] = {}
        self.optional: dict[str, tuple[int, ...]] = {}

    def norms(self, i: int) -> None:
        """The pre-norms `attn_norm` and `ffn_norm` `[d]` of layer `i`."""
        p, d = f"blk.{i}.", self.spec.n_embd
        self.required[p + "attn_norm.weight"] = self.required[p + "ffn_norm.weight"] = (d,)

    def gqa(self, i: int) -> None:
        """Grouped-query attention `attn_{q,k,v,output}` of layer `i` (and its q/k norms when
        the family has them: full width or per head)."""
        s, p, w = self.spec, f"blk.{i}.", self.required
        d, nh = s.n_embd, s.n_head
        kv, hk, hv = s.n_head_kv[i], s.head_dim_k, s.head_dim_v
        w[p + "attn_q.weight"] = (nh * hk, d)
        w[p + "attn_k.weight"] = (kv * hk, d)
        w[p + "attn_v.weight"] = (kv * hv, d)
        w[p + "attn_output.weight"] = (d, nh * hv)
        if s.qk_norm != "none":
            norm = (nh * hk,) if s.qk_norm == "full" else (hk,)
            w[p + "attn_q_norm.weight"] = w[p + "attn_k_norm.weight"] = norm

    def ffn(self, i: int, width: int, tag: str = "") -> None:
        """A dense gated FFN `ffn_{gate,up,down}{tag}` of `width`."""
        p, w, d = f"blk.{i}.ffn_", self.required, self.spec.n_embd
        w[f"{p}gate{tag}.weight"] = w[f"{p}up{tag}.weight"] = (width, d)
        w[f"{p}down{tag}.weight"] = (d, width)

    def router(self, i: int, bias: str = "optional") -> None:
        """`ffn_gate_inp` `[E, d]` and the selection bias `exp_probs_b` `[E]` (``bias``:
        "required" or "optional")."""
        s = self.spec
        self.required[f"blk.{i}.ffn_gate_inp.weight"] = (s.n_experts, s.n_embd)
        table = self.required if bias == "required" else self.optional
        table[f"blk.{i}.exp_probs_b.bias"] = (s.n_experts,)

    def ffn_or_moe(self, i: int, bias: str = "optional") -> None:
        """Layer `i`'s FFN: the router (and the shared experts, when the model has them) in an
        MoE layer, else a dense FFN of `n_ff`."""
        s = self.spec
        if i in s.moe_layers:
            self.router(i, bias)
            if s.n_ff_shexp:
                self.ffn(i, s.n_ff_shexp, "_shexp")
        else:
            self.ffn(i, s.n_ff)
