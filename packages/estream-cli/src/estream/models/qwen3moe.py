"""Qwen3-MoE (llama.cpp `qwen3moe`): pre-norm transformer, per-head q/k RMSNorm, softmax top-k
router with the selected weights renormalised, every layer a mixture of SwiGLU experts.

Its layer is OLMoE's: the differences (q/k norm kind, RoPE type, router renormalisation) are facts
of `ModelSpec` that the shared ops read, so the weights and the forward pass are reused from
`olmoe` rather than written out a second time. Give it its own body here when it diverges.
"""

from __future__ import annotations

from .olmoe import Layer, bind, layer

__all__ = ["ATTENTION_AUTO", "Layer", "bind", "layer"]

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: f32, as bf16's error here is not within 5 % of fp32 attention's (q4_0, 32
#: prompts: ×1.050 [1.005, 1.099]: its per-head q/k norms; docs/benchmarks.md, parity).
ATTENTION_AUTO = "f32"
