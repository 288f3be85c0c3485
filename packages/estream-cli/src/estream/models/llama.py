"""Mixtral (llama.cpp `llama` with experts): pre-norm transformer, no q/k norm, adjacent-pair
("normal") RoPE, softmax top-k router renormalised, every layer a mixture of SwiGLU experts.

Its layer is OLMoE's: the differences (q/k norm kind, RoPE type, router renormalisation) are facts
of `ModelSpec` that the shared ops read, so the weights and the forward pass are reused from
`olmoe` rather than written out a second time. Give it its own body here when it diverges.
"""

from __future__ import annotations

from .olmoe import Layer, bind, layer

#: What ``attention="auto"`` runs under q8 activations on a kernel set with native bf16
#: products: bf16, whose error here is within 5 % of fp32 attention's on every parity row
#: (Mixtral, 32 prompts each: q4_0 ×0.992 of it, llama.cpp's Q4_0 ×0.989, Q4_K_M ×0.980,
#: Q5_K_M ×1.014, Q6_K ×0.990, Q8_0 ×1.020; docs/benchmarks.md, parity).
ATTENTION_AUTO = "bf16"

__all__ = ["ATTENTION_AUTO", "Layer", "bind", "layer"]
