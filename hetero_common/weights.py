"""A model's weights as both planes see them: a fingerprint of sampled weight values, so
that the control plane can tell whether two compute planes hold the same weights (one
fine-tune, not two of the same shape), whatever form each read them from (a GGUF file,
an HF folder; quantized in the file or not; `--quantization` plays no part: it is taken
from the weights as loaded, before the engine quantizes them).

Values, not file bytes: a GGUF conversion and its HF folder share no byte, but hold the
same numbers up to the GGUF's quantization. The fingerprint is SAMPLES values of each
tensor `sampled_names` lists (present in every supported architecture), at fixed flat
positions (`positions`), as float32, each tensor with a flag saying whether the file
stored it lossily (a GGUF quantized type, an FP8 checkpoint's matrix). Two tensors agree
when their samples lie within a relative distance (`TIGHT` when both were stored exactly:
the rounding of one dense dtype to another; `LOOSE` when either was quantized: 2-4 bit
quantization's error). Norms are stored exactly in every form (GGUF keeps 1-D tensors in
F32), so a fine-tune that moved its norms is told apart even from a quantized copy; one
that moved only matrices, by less than the quantization's error (a merged low-rank
adapter), is told apart only between exactly stored forms.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

VERSION = 1
SAMPLES = 16  # values per tensor
TIGHT = 4e-3  # relative distance of exactly stored copies: bf16 rounding is <= 2**-9
LOOSE = 0.5  # of a quantized copy (Q8_0 ~0.005, Q4_0 ~0.09); unrelated weights ~1.4
_ENTRY = struct.Struct(f"<B{SAMPLES}f")
# Every matrix, not a few: an adapter merged into only some (LoRA's q_proj and v_proj) is
# another fine-tune too.
_LAYER = (
    "input_layernorm",
    "post_attention_layernorm",
    *(f"self_attn.{x}_proj" for x in "qkvo"),
    *(f"mlp.{x}_proj" for x in ("gate", "up", "down")),
)


def sampled_names(num_layers: int) -> list[str]:
    """The tensors sampled, in fingerprint order (Hugging Face names)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.{part}.weight" for part in _LAYER]
    return names


def positions(numel: int) -> list[int]:
    """The flat (row-major) positions sampled in a tensor of `numel` values: one in each
    of SAMPLES equal stretches, at a varying offset (not one column throughout)."""
    stretch = max(1, numel // SAMPLES)
    return [min(numel - 1, j * stretch + (j * 2654435761) % stretch) for j in range(SAMPLES)]


def encode(samples: Sequence[tuple[bool, Sequence[float]]]) -> bytes:
    """The fingerprint of (stored lossily, its SAMPLES values) per tensor of
    `sampled_names`, in that order."""
    out = bytearray([VERSION])
    for lossy, values in samples:
        out += _ENTRY.pack(int(lossy), *values)
    return bytes(out)


def _decode(fp: bytes) -> list[tuple[bool, tuple[float, ...]]] | None:
    """(stored lossily, values) per tensor; None for no fingerprint or one this version
    cannot read."""
    if not fp or fp[0] != VERSION or (len(fp) - 1) % _ENTRY.size:
        return None
    entries = [(bool(e[0]), e[1:]) for e in _ENTRY.iter_unpack(fp[1:])]
    if len(entries) < 2 or (len(entries) - 2) % len(_LAYER):
        return None
    return entries


def _distance(a: Sequence[float], b: Sequence[float]) -> float:
    """|a - b| / max(|a|, |b|) (0 for two zero vectors; NaN counts as far)."""
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    scale = max(math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b)))
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 and math.isfinite(diff) else math.inf


def difference(a: bytes, b: bytes) -> str | None:
    """Why two fingerprints are of different weights (the first tensor that differs and
    by how much), or None: they agree, or either is empty or of another version (a compute
    plane that sends none: nothing to say)."""
    da, db = _decode(a), _decode(b)
    if da is None or db is None:
        return None
    if len(da) != len(db):
        return f"{len(da)} tensors sampled, not {len(db)}"
    names = sampled_names((len(da) - 2) // len(_LAYER))
    for name, (lossy_a, va), (lossy_b, vb) in zip(names, da, db, strict=True):
        limit = LOOSE if lossy_a or lossy_b else TIGHT
        d = _distance(va, vb)
        if not d <= limit:
            return f"{name} differs (sampled values {d:.3g} apart, relative; at most {limit:g})"
    return None
