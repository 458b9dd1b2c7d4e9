"""The CPU's fused decode step: a decode-only step's whole forward in one C call.

At batch 1 the torch forward of the bundled model spends ~10 ms per step dispatching
its small per-layer operations, as long as its quantized matmuls take to read the
weights. `csrc/decode_cpu.c` runs every layer of a step whose rows are all decodes (one
token each, at most MAX_KERNEL_ROWS of them) in C, on the quantized linear and paged
attention kernels: the same fp32 operations in the same order, so the same result to
rounding (tests/compute/test_decode_cpu.py), in about the time of the matmuls alone.

The model uses it where it applies: CPU, fp32, the `cpu` attention backend, and every
layer matrix quantized (`--quantization auto` with a quantized GGUF, or `int8`); every
supported architecture, Gemma 3's sandwich norms, GELU, scaled embeddings and
sliding-window layers with their own rotary tables included.
Prefill chunks, mixed steps and other models keep the torch forward.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from compute_plane.native import KernelUnavailable, load_library
from compute_plane.quant import MAX_KERNEL_ROWS, QuantWeight, Weight
from compute_plane.scaled import ScaledWeight

if TYPE_CHECKING:
    from compute_plane.attention import AttentionMetadata
    from compute_plane.model import Model

log = logging.getLogger(__name__)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_KINDS = {"dense": 0, "q4": 1, "q8": 2}
_ACTS = {"silu": 0, "gelu_tanh": 1}


class _DWeight(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("kind", "n", "k", "half")] + [
        (n, _ptr) for n in ("codes", "scales", "bias")
    ]


class _DLayer(ctypes.Structure):
    _fields_ = [
        *((n, _ptr) for n in ("input_norm", "post_norm", "q_norm", "k_norm")),
        *((n, _DWeight) for n in ("qkv", "o", "gate_up", "down")),
        *((n, _ptr) for n in ("k_cache", "v_cache", "cos", "sin")),
        ("window", _i64),
        *((n, _ptr) for n in ("attn_out_norm", "mlp_out_norm")),
    ]


_SHAPE = ("num_layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "block_size")


class _DModel(ctypes.Structure):
    _fields_ = [
        *((n, _i64) for n in _SHAPE),
        ("exact", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("embed", _DWeight),
        ("embed_scale", ctypes.c_float),
        ("act", _i64),
        ("final_norm", _ptr),
        ("layers", ctypes.POINTER(_DLayer)),
    ]


@functools.cache
def load_kernel() -> Callable[..., int]:
    fn = load_library("decode_cpu").decode_forward_f32
    fn.argtypes = [ctypes.POINTER(_DModel), _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
    fn.restype = ctypes.c_int
    return fn


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(w: Weight, bias: torch.Tensor | None = None) -> _DWeight:
    if isinstance(w, QuantWeight):
        n, k = w.shape
        return _DWeight(
            _KINDS[w.kind], n, k, w.half, w.codes.data_ptr(), w.scales.data_ptr(), _ptr_of(bias)
        )
    assert isinstance(w, torch.Tensor), "FP8/INT8 weights do not run the fused CPU step"
    return _DWeight(0, w.shape[0], w.shape[1], 0, w.data_ptr(), None, _ptr_of(bias))


def unsupported(model: Model) -> str | None:
    """Why the fused step does not apply to `model`, or None when it does."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not on the CPU in fp32"
    if model.attention.name != "cpu":
        return f"attention backend {model.attention.name!r}, not 'cpu'"
    for layer in model.layers:
        if not all(
            isinstance(w, QuantWeight) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ):
            return "dense layer weights"
    e = model.embed
    if isinstance(e, ScaledWeight):
        return "embedding layout"
    if not isinstance(e, QuantWeight) and not (e.is_contiguous() and e.dtype == torch.float32):
        return "embedding layout"
    return None


def fused_decode(model: Model) -> FusedDecode | None:
    """The fused step for `model` where it applies and its kernel builds, else None."""
    if (reason := unsupported(model)) is not None:
        log.debug("fused CPU decode off: %s", reason)
        return None
    try:
        return FusedDecode(model)
    except KernelUnavailable as e:
        log.warning("fused CPU decode unavailable (%s): decodes run the torch forward", e)
        return None


class FusedDecode:
    """Runs a decode-only step of `model` (at most `max_rows` rows) by decode_forward_f32."""

    max_rows = MAX_KERNEL_ROWS

    def __init__(self, model: Model) -> None:
        cfg = model.cfg
        self._kernel = load_kernel()
        tables = {
            window: (rotary.cos.contiguous(), rotary.sin.contiguous())
            for window, rotary in ((None, model.rotary), (0, model.rotary_local))
        }
        self._keep: list[object] = [model, tables]  # what the raw pointers point into
        self._layers = (_DLayer * cfg.num_layers)()
        for c, layer in zip(self._layers, model.layers, strict=True):
            c.input_norm, c.post_norm = layer.input_norm.data_ptr(), layer.mlp_norm.data_ptr()
            c.q_norm, c.k_norm = _ptr_of(layer.q_norm), _ptr_of(layer.k_norm)
            c.qkv = _weight(layer.qkv, layer.qkv_bias)
            c.o, c.gate_up, c.down = _weight(layer.o), _weight(layer.gate_up), _weight(layer.down)
            cos, sin = tables[None if layer.window is None else 0]
            c.cos, c.sin, c.window = cos.data_ptr(), sin.data_ptr(), layer.window or 0
            c.attn_out_norm = _ptr_of(layer.attn_out_norm)
            c.mlp_out_norm = _ptr_of(layer.mlp_out_norm)
        self._model = _DModel(
            cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_kv_heads, cfg.head_dim, 0, model.activations == "fp32", cfg.rms_norm_eps,
            cfg.scale, _weight(model.embed), cfg.embedding_scale or 0.0,
            _ACTS[cfg.hidden_act], model.final_norm.data_ptr(), self._layers,
        )  # fmt: skip
        self._caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._hidden = cfg.hidden_size

    def _bind_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if kv_caches is self._caches:
            return
        for c, (k, v) in zip(self._layers, kv_caches, strict=True):
            if not (k.is_contiguous() and v.is_contiguous() and k.dtype == torch.float32):
                raise ValueError("the fused CPU decode needs contiguous fp32 KV caches")
            c.k_cache, c.v_cache = k.data_ptr(), v.data_ptr()
        self._model.block_size = kv_caches[0][0].shape[1]
        self._caches = kv_caches  # held: the pointers stay valid while it is

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The final-norm hidden states [M, hidden]; K/V of the M tokens are written."""
        self._bind_caches(kv_caches)
        m = input_ids.numel()
        ids, pos, slots = (
            t.to(torch.int64).contiguous() for t in (input_ids, positions, meta.slot_mapping)
        )
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            tables = tables.to(torch.int32).contiguous()
        lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        out = torch.empty(m, self._hidden, dtype=torch.float32)
        failed = self._kernel(
            ctypes.byref(self._model), m, ids.data_ptr(), pos.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"the fused CPU decode failed ({failed}) for {m} rows")
        return out
