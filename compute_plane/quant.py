"""Weights that stay quantized in memory, and the CPU linear layers that run on them.

A GGUF file's Q4_0, Q4_1 and Q4_K weights load as `q4` (4-bit codes, a scale and an
offset per group of 32 input channels: exactly what those formats store), Q8_0 as `q8`
(int8 codes, a scale per group of 32); other formats (Q6_K, Q5_*, ...) are dequantized
and re-quantized to `q8`. `--quantization int8` turns dense weights into `q8` too.

A few rows (decode) run on the C kernel in `csrc/quant_linear_cpu.c`, which reads the
codes where they lie: a decode step reads ~0.6-1.1 bytes per weight instead of 4. Many
rows (prefill) dequantize the layer to fp32 and use the dense GEMM, whose cost the rows
amortise. Embedding rows are dequantized as they are looked up.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K, dequantize

from compute_plane.native import KernelUnavailable, load_library

log = logging.getLogger(__name__)

GROUP = 32
MAX_KERNEL_ROWS = 128  # above this many rows (prefill), dequantize + dense GEMM is faster
QUANTIZATIONS = ("auto", "none", "int8")
# How the decode kernels multiply activations by quantized weights (csrc/quant_linear_cpu.c):
# int16: x rounded to int16 per group of 32, integer multiply-adds; fp32: exact.
ACTIVATIONS = ("int16", "fp32")


@dataclass(frozen=True)
class _Kernels:
    q4_linear: Callable[..., int]
    q8_linear: Callable[..., int]
    q4_dequant: Callable[..., None]
    q8_dequant: Callable[..., None]
    int16: bool  # the kernels round activations to int16 when asked (AVX2 builds)


@functools.cache
def load_kernels() -> _Kernels:
    """The C kernel's entry points (KernelUnavailable where it cannot be built)."""
    lib = load_library("quant_linear_cpu")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("q4_linear_f32", "q8_linear_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    for name in ("q4_dequant_f32", "q8_dequant_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, i64, ptr, i64, ptr]
        fn.restype = None
    lib.int16_activations_supported.restype = ctypes.c_int
    return _Kernels(
        lib.q4_linear_f32, lib.q8_linear_f32, lib.q4_dequant_f32, lib.q8_dequant_f32,
        bool(lib.int16_activations_supported()),
    )  # fmt: skip


def kernels_available() -> bool:
    try:
        load_kernels()
    except KernelUnavailable as e:
        log.warning("quantized CPU kernels unavailable (%s): weights are dequantized", e)
        return False
    return True


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight in groups of 32 along K.

    q4: `codes` uint8 [N, K/2] (byte j of a group: element j low, j + 16 high nibble),
        `scales` fp32 [N, K/32, 2] = (s, b): w = s * code + b.
    q8: `codes` int8 [N, K], `scales` fp32 [N, K/32]: w = s * code.
    """

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        n = self.codes.shape[0]
        k = self.codes.shape[1] * (2 if self.kind == "q4" else 1)
        return n, k

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or some of its rows) as fp32 [R, K]."""
        n, k = self.shape
        ids = torch.arange(n) if rows is None else rows.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        ks = load_kernels()
        fn = ks.q4_dequant if self.kind == "q4" else ks.q8_dequant
        fn(
            self.codes.data_ptr(), self.scales.data_ptr(), k, ids.data_ptr(), ids.numel(),
            out.data_ptr(),
        )  # fmt: skip
        return out

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, activations: str = "int16"
    ) -> torch.Tensor:
        """x [M, K] fp32 @ w.T (+ bias) -> [M, N] fp32; `activations` (ACTIVATIONS) is how
        the kernel multiplies up to MAX_KERNEL_ROWS rows (more: dequantize + fp32 GEMM)."""
        n, k = self.shape
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if m > MAX_KERNEL_ROWS:
            if activations == "int16" and load_kernels().int16:
                x2 = round_int16(x2)  # as the kernel rounds them: batch-independent results
            return torch.nn.functional.linear(x2, self.dequantize(), bias).reshape(*x.shape[:-1], n)
        x2 = x2.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        ks = load_kernels()
        fn = ks.q4_linear if self.kind == "q4" else ks.q8_linear
        failed = fn(
            x2.data_ptr(), m, k, self.codes.data_ptr(), self.scales.data_ptr(),
            None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(), n,
            activations == "fp32",
        )  # fmt: skip
        if failed:
            raise MemoryError(f"quantized linear failed ({failed}) for {m}x{k} @ {n}x{k}")
        return y.reshape(*x.shape[:-1], n)

    def take_rows(self, perm: np.ndarray) -> QuantWeight:
        idx = torch.from_numpy(np.ascontiguousarray(perm, dtype=np.int64))
        return QuantWeight(self.kind, self.codes[idx].contiguous(), self.scales[idx].contiguous())


def round_int16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded as the kernels' int16 mode rounds it: per group of 32, to steps of
    the group's largest magnitude / 32767 (round half to even, as lrintf)."""
    m, k = x.shape
    g = x.reshape(m, k // GROUP, GROUP)
    top = g.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 32767.0 / top, torch.zeros_like(top))
    return (torch.round(g * inv) * (top / 32767.0)).reshape(m, k)


def cat(parts: Sequence[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight:
    """Concatenate weights along N (fusing q|k|v, gate|up); dense if the kinds differ."""
    kinds = {p.kind if isinstance(p, QuantWeight) else "dense" for p in parts}
    if len(kinds) == 1 and "dense" not in kinds:
        qs = [p for p in parts if isinstance(p, QuantWeight)]
        return QuantWeight(
            qs[0].kind, torch.cat([p.codes for p in qs]), torch.cat([p.scales for p in qs])
        )
    return torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts])


def quantize_q8(w: torch.Tensor) -> QuantWeight:
    """Dense [N, K] -> q8, symmetric per group of 32 (K padded: not needed, K % 32 == 0)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    s = g.abs().amax(-1) / 127.0
    codes = torch.round(g / s.clamp_min(1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantWeight("q8", codes.reshape(n, k).contiguous(), s.contiguous())


Weight = torch.Tensor | QuantWeight


def prepare(weights: Mapping[str, Weight], mode: str | None) -> dict[str, Weight]:
    """The weights a model runs on: mode None dequantizes every QuantWeight; "int8"
    also quantizes the dense matrices (not norms or biases) to q8; "gguf" keeps both."""
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        if isinstance(w, QuantWeight) and mode is None:
            w = w.dequantize()
        elif mode == "int8" and isinstance(w, torch.Tensor) and _matrix(w):
            w = quantize_q8(w)
        out[name] = w
    return out


def _matrix(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.shape[1] % GROUP == 0


def weight_bytes(weights: Mapping[str, Weight]) -> int:
    """What the weights take in memory; a tied weight counted once."""
    seen: dict[int, int] = {}
    for w in weights.values():
        t = w.codes if isinstance(w, QuantWeight) else w
        seen[id(t)] = w.nbytes
    return sum(seen.values())


# ------------------------------------------------------------------ GGUF
def from_gguf(data: np.ndarray, qtype: QT, n: int, k: int) -> QuantWeight | None:
    """A GGUF tensor's raw blocks -> QuantWeight; None for unquantized or odd shapes."""
    if k % GROUP or qtype in (QT.F32, QT.F16, QT.BF16, QT.F64):
        return None
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(n, -1)
    if qtype in (QT.Q4_0, QT.Q4_1):
        width = 18 if qtype == QT.Q4_0 else 20
        blocks = raw.reshape(n, k // GROUP, width)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        if qtype == QT.Q4_0:
            b = -8.0 * d
        else:
            b = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        return _q4(blocks[..., width - 16 :], d, b, n, k)
    if qtype == QT.Q8_0:
        blocks = raw.reshape(n, k // GROUP, 34)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantWeight("q8", torch.from_numpy(codes), torch.from_numpy(d))
    if qtype == QT.Q4_K:
        return _q4_k(raw, n, k)
    dense = dequantize(raw, qtype).reshape(n, k)
    return quantize_q8(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)))


def _q4(qs: np.ndarray, s: np.ndarray, b: np.ndarray, n: int, k: int) -> QuantWeight:
    codes = np.ascontiguousarray(qs).reshape(n, k // 2)
    sb = np.stack([s, b], axis=-1).astype(np.float32)
    return QuantWeight("q4", torch.from_numpy(codes), torch.from_numpy(sb))


def _q4_k(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    """Q4_K: super-blocks of 256 = 8 groups of 32, w = d*sc_j*q - dmin*m_j."""
    nb = k // 256
    blocks = raw.reshape(n * nb, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    s = d * sc.astype(np.float32)  # [n*nb, 8]
    b = -dmin * mn.astype(np.float32)
    # qs: 4 chunks of 32 bytes; chunk i holds group 2i in its low and 2i+1 in its high nibbles.
    qs = blocks[:, 16:].reshape(n * nb, 4, 1, 32)
    vals = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [.., 4, 2, 32]
    vals = vals.reshape(n * nb * 8, 32)
    packed = vals[:, :16] | (vals[:, 16:] << 4)  # our order: j low, j + 16 high
    return _q4(packed.reshape(n, k // 2), s.reshape(n, -1), b.reshape(n, -1), n, k)
