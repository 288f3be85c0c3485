"""Mixtral (llama.cpp `llama` with experts): pre-norm transformer, no q/k norm, adjacent-pair
("normal") RoPE, softmax top-k router renormalised, every layer a mixture of SwiGLU experts.

Its layer is OLMoE's: the differences (q/k norm kind, RoPE type, router renormalisation) are facts
of `ModelSpec` that the shared ops read, so the weights and the forward pass are reused from
`olmoe` rather than written out a second time. Give it its own body here when it diverges.
"""

from __future__ import annotations

from .olmoe import Layer, bind, layer

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: bf16, whose error here is within 5 % of fp32 attention's (q4_0, 32 prompts:
#: Mixtral: ×0.992 [0.941, 1.046] of it; docs/benchmarks.md, parity).
ATTENTION_AUTO = "bf16"

__all__ = ["ATTENTION_AUTO", "Layer", "bind", "layer"]
