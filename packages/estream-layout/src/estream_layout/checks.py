"""What loading a pack checks beyond the manifest's own validation, in one place.

`check_pack` is run by the engine's load and by `estream-pack --verify` (which adds every
checksum and the finiteness of every weight), so a pack that verifies is a pack that loads:
model.gguf's crc32 (it is small), the spec read back as the engine reads it, model.gguf's
metadata agreeing with the spec and with the manifest's `arch`, every dense tensor the family's
layers are built from present with its shape. (What the engine itself does not implement, e.g.
layers with different expert record layouts, stays the engine's to refuse.)
"""

from __future__ import annotations

import zlib
from typing import Any, Final

from .errors import ChecksumError, LayoutError, PackFormatError
from .gguf_header import read_header
from .gguf_model import ModelSpec, dense_tensor_problems
from .manifest import Manifest

__all__ = ["check_pack"]

# Spec fields that model.gguf (crc32-checked) states directly: a manifest whose spec disagrees
# with its own model.gguf is refused even if its digest was rewritten to match.
_GGUF_SPEC_KEYS: Final = (
    ("n_layers", "{arch}.block_count"),
    ("n_embd", "{arch}.embedding_length"),
    ("n_head", "{arch}.attention.head_count"),
    ("n_head_kv", "{arch}.attention.head_count_kv"),
    ("n_experts", "{arch}.expert_count"),
    ("n_experts_used", "{arch}.expert_used_count"),
    ("rms_eps", "{arch}.attention.layer_norm_rms_epsilon"),
    ("rope_freq_base", "{arch}.rope.freq_base"),
    ("rope_dims", "{arch}.rope.dimension_count"),
    ("n_ctx", "{arch}.context_length"),
)


def _as_spec_value(have: Any, raw: Any) -> Any:
    """`raw` (a model.gguf value) in the type of the spec's field `have`; None if it cannot be."""
    try:
        if isinstance(have, tuple):
            items = raw if isinstance(raw, list | tuple) else [raw]
            want = tuple(int(x) for x in items)
            return want * len(have) if len(want) == 1 else want
        if isinstance(raw, list | tuple):
            raw = max(raw) if raw else None
        if isinstance(raw, bool | str) or raw is None:
            return None
        return type(have)(raw)
    except (TypeError, ValueError, OverflowError):
        return None


def _check_spec_against_gguf(m: Manifest, spec: ModelSpec) -> None:
    where = m.root / "manifest.json"
    try:
        kv = read_header(m.model_gguf_path).kv
    except (OSError, EOFError, ValueError, OverflowError, RecursionError) as e:
        raise PackFormatError(f"{m.model_gguf_path}: not a readable GGUF file ({e})") from None
    arch = kv.get("general.architecture")
    if arch != m.arch:
        raise PackFormatError(
            f"{where}: arch is {m.arch!r}, but model.gguf is a {arch!r} model: the manifest and "
            "model.gguf disagree; re-pack"
        )
    for field, key in _GGUF_SPEC_KEYS:
        raw = kv.get(key.format(arch=spec.arch))
        if raw is None:
            continue
        have = getattr(spec, field)
        want = _as_spec_value(have, raw)
        if want != have:
            raise PackFormatError(
                f"{where}: spec.{field} = {have!r}, but model.gguf says {raw!r}: the manifest "
                "and model.gguf disagree; re-pack"
            )


def check_pack(m: Manifest) -> ModelSpec:
    """Every check a load runs on a validated manifest `m` before it reads a weight; returns
    the model's spec (what the engine builds its graph from).

    Raises ChecksumError (model.gguf's crc32) or PackFormatError (named field or tensor): the
    same classes and messages for `estream-pack --verify` and for a load."""
    try:
        data = m.model_gguf_path.read_bytes()
    except OSError as e:
        raise PackFormatError(f"{m.model_gguf_path}: cannot read ({e.strerror or e})") from None
    if zlib.crc32(data) != m.model_gguf_crc32:
        raise ChecksumError(
            f"{m.model_gguf_path}: checksum mismatch; the metadata is corrupt or from another "
            "model, re-pack"
        )
    del data
    where = m.root / "manifest.json"
    try:
        spec = ModelSpec.from_dict(m.spec)
    except LayoutError as e:
        raise PackFormatError(f"{where}: {e}") from None
    _check_spec_against_gguf(m, spec)
    if tuple(la.index for la in m.layers) != spec.moe_layers:
        raise PackFormatError(f"{where}: layers differ from spec.moe_layers")
    problems = dense_tensor_problems(spec, {n: t.shape for n, t in m.dense.items()})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PackFormatError(f"{where}: dense {problems[0]}{more}; re-pack the model")
    return spec
