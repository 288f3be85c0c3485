"""Qwen3-MoE (llama.cpp `qwen3moe`): pre-norm transformer, per-head q/k RMSNorm, softmax top-k
router with the selected weights renormalised, every layer a mixture of SwiGLU experts.

Its layer is OLMoE's: the differences (q/k norm kind, RoPE type, router renormalisation) are facts
of `ModelSpec` that the shared ops read, so the weights and the forward pass are reused from
`olmoe` rather than written out a second time. Give it its own body here when it diverges.
"""

from __future__ import annotations

from .olmoe import Layer, bind, layer

__all__ = ["Layer", "bind", "layer"]
