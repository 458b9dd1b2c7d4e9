"""Weights that stay quantized in memory, and the CPU linear layers that run on them.

A GGUF file's Q4_0, Q4_1 and Q4_K weights load as `q4` (4-bit codes, a scale and an
offset per group of 32 input channels: exactly what those formats store), Q8_0 and Q5_0
as `q8` (int8 codes, a scale per group of 32; Q5_0's 5-bit codes times 8, its scale over
8: exact too); other formats (Q6_K, Q5_1, ...) are dequantized and re-quantized to `q8`.
`--quantization int8` turns dense weights into `q8` too.

Scales are kept in fp16 where fp16 holds every one of a weight's exactly (Q4_0, Q4_1,
Q8_0 and Q5_0 store theirs in fp16; re-quantized `q8` picks fp16 scales where it can),
else fp32 (Q4_K's d * sc): a decode step is bound by the bytes it reads, and fp16 scales
take a q4 weight from 0.75 to 0.625 bytes, a q8 one from 1.125 to 1.0625, with the same
result bit for bit.

Every linear on them runs on the C kernel in `csrc/quant_linear_cpu.c`, which reads the
codes where they lie (a decode step reads ~0.6-1.1 bytes per weight instead of 4) in
blocks of 16 output channels (`pack` makes the layout at load); it is faster than
dequantizing + the dense GEMM at every row count measured (1-2048 rows), and a row's
result does not depend on the rows beside it. Embedding rows are dequantized as they are
looked up.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K, dequantize

from compute_plane.native import KernelUnavailable, load_library
from compute_plane.scaled import ScaledWeight, quantize, reencode

log = logging.getLogger(__name__)

GROUP = 32
BLOCK = 16  # output channels per block of the kernels' layout
MAX_KERNEL_ROWS = 128  # the most rows of a fused decode step (decode_cpu.py)
QUANTIZATIONS = ("auto", "none", "int8", "fp8")
# How the decode kernels multiply activations by quantized weights (csrc/quant_linear_cpu.c):
# int16: x rounded to int16 per group of 32, integer multiply-adds; fp32: exact.
ACTIVATIONS = ("int16", "fp32")


@dataclass(frozen=True)
class _Kernels:
    q4_linear: Callable[..., int]
    q8_linear: Callable[..., int]
    q4_dequant: Callable[..., None]
    q8_dequant: Callable[..., None]
    q4_pack: Callable[..., None]
    q8_pack: Callable[..., None]
    int16_kind: int  # the int16 kernel built here: 2 AVX-512, 1 AVX2, 0 plain C


@functools.cache
def load_kernels() -> _Kernels:
    """The C kernel's entry points (KernelUnavailable where it cannot be built)."""
    lib = load_library("quant_linear_cpu")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("q4_linear_f32", "q8_linear_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int, ptr, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    for name in ("q4_dequant_f32", "q8_dequant_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ctypes.c_int, i64, ptr, i64, ptr]
        fn.restype = None
    for name in ("q4_pack", "q8_pack"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr]
        fn.restype = None
    lib.int16_kernel_kind.restype = ctypes.c_int
    log.info(
        "quantized CPU kernels: int16 path %s",
        ("plain C", "AVX2", "AVX-512")[lib.int16_kernel_kind()],
    )
    return _Kernels(
        lib.q4_linear_f32, lib.q8_linear_f32, lib.q4_dequant_f32, lib.q8_dequant_f32,
        lib.q4_pack, lib.q8_pack, lib.int16_kernel_kind(),
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
    """A [N, K] weight in groups of 32 along K, in the kernels' layout (channels in blocks
    of 16, csrc/quant_linear_cpu.c); `pack` builds one from the row layout, `rows` gives
    that back:

    q4: codes uint8 [N, K/2] (byte j of a group: element j low, j + 16 high nibble),
        scales fp32 [N, K/32, 2] = (s, b): w = s * code + b.
    q8: codes int8 [N, K], scales fp32 [N, K/32]: w = s * code.

    Packed, the scales are fp16 when fp16 holds them all exactly (`half`), else fp32.
    """

    kind: str
    codes: torch.Tensor  # packed: [ceil(N/16), K/32 * 256 (q4) or 512 (q8)] bytes
    scales: torch.Tensor  # packed: [ceil(N/16), K/32 * 32 (q4) or 16 (q8)] fp16 or fp32
    n: int
    k: int

    @classmethod
    def pack(
        cls,
        kind: str,
        codes: torch.Tensor,
        scales: torch.Tensor,
        rows: np.ndarray | None = None,
    ) -> QuantWeight:
        """From the row layout above (on the C kernel); `rows`: channel r is row rows[r]."""
        n = codes.shape[0] if rows is None else len(rows)
        k = codes.shape[1] * (2 if kind == "q4" else 1)
        nb, ng = -(-n // BLOCK), k // GROUP
        want = torch.uint8 if kind == "q4" else torch.int8
        per_row = ng * (2 if kind == "q4" else 1)  # scales of a row
        if codes.dim() != 2 or codes.dtype != want or k % GROUP:
            raise ValueError(f"{kind} codes: {want} [N, K], got {codes.dtype} {list(codes.shape)}")
        if scales.numel() != codes.shape[0] * per_row:
            raise ValueError(f"{kind} scales: {per_row} a row, got {list(scales.shape)}")
        codes, scales = codes.contiguous(), scales.to(torch.float32).contiguous()
        out_codes = torch.empty(nb, ng * (256 if kind == "q4" else 512), dtype=codes.dtype)
        out_scales = torch.empty(nb, ng * (2 if kind == "q4" else 1) * BLOCK)
        ids = None
        if rows is not None:
            ids = np.ascontiguousarray(rows, dtype=np.int64)
            if len(ids) and (ids.min() < 0 or ids.max() >= codes.shape[0]):
                raise IndexError(f"rows out of range for {codes.shape[0]} rows")
        ks = load_kernels()
        fn = ks.q4_pack if kind == "q4" else ks.q8_pack
        fn(
            codes.data_ptr(), scales.data_ptr(), n, k, None if ids is None else ids.ctypes.data,
            out_codes.data_ptr(), out_scales.data_ptr(),
        )  # fmt: skip
        return cls(kind, out_codes, _narrow(out_scales), n, k)

    @property
    def half(self) -> bool:
        """Whether the scales are fp16 (else fp32)."""
        return self.scales.dtype == torch.float16

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) in the row layout."""
        c, s = _unpack(self.kind, self.codes.numpy(), self.scales.numpy(), self.n, self.k)
        return torch.from_numpy(c), torch.from_numpy(s)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

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
            self.codes.data_ptr(), self.scales.data_ptr(), self.half, k, ids.data_ptr(),
            ids.numel(), out.data_ptr(),
        )  # fmt: skip
        return out

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, activations: str = "int16"
    ) -> torch.Tensor:
        """x [M, K] fp32 @ w.T (+ bias) -> [M, N] fp32 on the C kernel; `activations`
        (ACTIVATIONS) is how it multiplies. Every row is computed as it would be alone."""
        n, k = self.shape
        x2 = x.reshape(-1, k).contiguous()
        m = x2.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        ks = load_kernels()
        fn = ks.q4_linear if self.kind == "q4" else ks.q8_linear
        failed = fn(
            x2.data_ptr(), m, k, self.codes.data_ptr(), self.scales.data_ptr(), self.half,
            None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(), n,
            activations == "fp32",
        )  # fmt: skip
        if failed:
            raise MemoryError(f"quantized linear failed ({failed}) for {m}x{k} @ {n}x{k}")
        return y.reshape(*x.shape[:-1], n)


def _narrow(scales: torch.Tensor) -> torch.Tensor:
    """fp32 scales as fp16 where fp16 holds every one exactly, else as they are."""
    half = scales.to(torch.float16)
    return half if torch.equal(half.float(), scales) else scales


def _unpack(
    kind: str, codes: np.ndarray, scales: np.ndarray, n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of QuantWeight.pack (csrc/quant_linear_cpu.c's q4_pack / q8_pack)."""
    nb, ng = codes.shape[0], k // GROUP
    scales = scales.astype(np.float32)
    if kind == "q4":
        b = codes.reshape(nb, ng, 8, BLOCK, 2)
        v = np.stack([b[..., 0] & 0x0F, b[..., 1] & 0x0F, b[..., 0] >> 4, b[..., 1] >> 4], -1)
        vals = v.transpose(0, 3, 1, 2, 4).reshape(nb * BLOCK, ng, 32)[:n]
        rows = vals[..., :16] | (vals[..., 16:] << 4)
        sb = scales.reshape(nb, ng, 2, BLOCK).transpose(0, 3, 1, 2).reshape(nb * BLOCK, ng, 2)
        return (
            np.ascontiguousarray(rows, dtype=np.uint8).reshape(n, k // 2),
            np.ascontiguousarray(sb[:n], dtype=np.float32),
        )
    c = codes.reshape(nb, ng, 16, BLOCK, 2).transpose(0, 3, 1, 2, 4).reshape(nb * BLOCK, k)
    s = scales.reshape(nb, ng, BLOCK).transpose(0, 2, 1).reshape(nb * BLOCK, ng)
    return (
        np.ascontiguousarray(c[:n], dtype=np.int8),
        np.ascontiguousarray(s[:n], dtype=np.float32),
    )


def cat(parts: Sequence[Weight]) -> Weight:
    """Concatenate weights along N (fusing q|k|v, gate|up); dense if the kinds differ."""
    quant = [p for p in parts if isinstance(p, QuantWeight)]
    if len(quant) == len(parts) and len({p.kind for p in quant}) == 1:
        if all(p.n % BLOCK == 0 for p in quant) and len({p.k for p in quant}) == 1:
            # Whole blocks of 16 rows each: the packed blocks simply follow one another.
            codes = torch.cat([p.codes for p in quant])
            scales = torch.cat([p.scales.float() for p in quant])  # (fp16 if all were)
            n = sum(p.n for p in quant)
            return QuantWeight(quant[0].kind, codes, _narrow(scales), n, quant[0].k)
        rows = [p.rows() for p in quant]
        codes, scales = torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])
        return QuantWeight.pack(quant[0].kind, codes, scales)
    scaled = [p for p in parts if isinstance(p, ScaledWeight)]
    if len(scaled) == len(parts) and len({p.kind for p in scaled}) == 1:
        data, scale = torch.cat([p.data for p in scaled]), torch.cat([p.scale for p in scaled])
        return ScaledWeight(scaled[0].kind, data, scale)
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    return torch.cat([p if isinstance(p, torch.Tensor) else _dense(p, dtype) for p in parts])


def _dense(w: QuantWeight | ScaledWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, ScaledWeight):
        return w.dequantize(dtype)
    return w.dequantize().to(dtype=dtype, device=w.codes.device)


def quantize_q8(w: torch.Tensor) -> QuantWeight:
    """Dense [N, K] -> q8, symmetric per group of 32 (K padded: not needed, K % 32 == 0).

    Each scale is max|w_g| / 127 rounded up to fp16 (a step at most 2^-10 coarser, and the
    weight then reads fewer bytes) where every group's is a normal fp16 number; else the
    weight keeps fp32 scales (a group of tiny weights would lose its precision)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    s = g.abs().amax(-1) / 127.0
    h = s.to(torch.float16)
    h = torch.where(h.float() < s, torch.nextafter(h, torch.full_like(h, math.inf)), h)
    if bool(((h == 0) | ((h >= 2.0**-14) & h.isfinite())).all()):
        s = h.float()
    codes = torch.round(g / s.clamp_min(1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantWeight.pack("q8", codes.reshape(n, k).contiguous(), s.contiguous())


Weight = torch.Tensor | QuantWeight | ScaledWeight
# The layer matrices --quantization fp8 / int8 (off the CPU's fp32 kernels) quantize.
_LAYER_MATRIX = re.compile(r"model\.layers\.\d+\..*_proj\.weight$")


def prepare(
    weights: Mapping[str, Weight], mode: str | None, device: torch.device | None = None
) -> dict[str, Weight]:
    """The weights a model runs on (mode: what device.resolve_quantization gave):

    None: every weight dense. "gguf": a GGUF's quantized matrices stay QuantWeight (CPU);
    "int8": dense matrices (not norms, biases) become q8 too (CPU). Off the CPU's fp32
    kernels: "fp8" / "int8_scaled" quantize each layer's projection matrices to FP8 /
    INT8 per output channel (compute_plane.scaled), "checkpoint" keeps only an FP8
    checkpoint's matrices in FP8. An FP8 matrix on a device without FP8 matmuls becomes
    INT8; with mode None or "gguf" it is dequantized."""
    dev = device or torch.device("cpu")
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        if isinstance(w, ScaledWeight):
            if mode == "int8_scaled" and w.kind == "fp8":
                w = quantize(w.dequantize(), "int8", dev)
            elif mode in ("fp8", "int8_scaled", "checkpoint"):
                w = reencode(w, dev)
            else:
                w = w.dequantize()
        elif isinstance(w, QuantWeight) and mode not in ("gguf", "int8"):
            w = w.dequantize()
        if isinstance(w, torch.Tensor) and _matrix(w):
            if mode == "int8":
                w = quantize_q8(w)
            elif mode in ("fp8", "int8_scaled") and _LAYER_MATRIX.search(name):
                kind = "fp8" if mode == "fp8" and w.shape[0] % 16 == 0 else "int8"
                w = quantize(w, kind, dev)
        out[name] = w
    return out


def _matrix(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.shape[1] % GROUP == 0


def weight_bytes(weights: Mapping[str, Weight]) -> int:
    """What the weights take in memory; a tied weight counted once."""
    seen: dict[int, int] = {}
    for w in weights.values():
        t = w.codes if isinstance(w, QuantWeight) else w.data if isinstance(w, ScaledWeight) else w
        seen[id(t)] = w.nbytes
    return sum(seen.values())


# ------------------------------------------------------------------ GGUF
def from_gguf(
    data: np.ndarray, qtype: QT, n: int, k: int, rows: np.ndarray | None = None
) -> QuantWeight | None:
    """A GGUF tensor's raw blocks -> QuantWeight (channel r: the tensor's row rows[r], if
    given); None for unquantized or odd shapes."""
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
        return _q4(blocks[..., width - 16 :], d, b, n, k, rows)
    if qtype == QT.Q8_0:
        blocks = raw.reshape(n, k // GROUP, 34)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantWeight.pack("q8", torch.from_numpy(codes), torch.from_numpy(d), rows)
    if qtype == QT.Q5_0:
        return _q5_0(raw, n, k, rows)
    if qtype == QT.Q4_K:
        return _q4_k(raw, n, k, rows)
    dense = dequantize(raw, qtype).reshape(n, k)
    if rows is not None:
        dense = dense[rows]
    return quantize_q8(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)))


def _q4(
    qs: np.ndarray, s: np.ndarray, b: np.ndarray, n: int, k: int, rows: np.ndarray | None
) -> QuantWeight:
    codes = np.ascontiguousarray(qs).reshape(n, k // 2)
    sb = np.stack([s, b], axis=-1).astype(np.float32)
    return QuantWeight.pack("q4", torch.from_numpy(codes), torch.from_numpy(sb), rows)


def _q4_k(raw: np.ndarray, n: int, k: int, rows: np.ndarray | None) -> QuantWeight:
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
    return _q4(packed.reshape(n, k // 2), s.reshape(n, -1), b.reshape(n, -1), n, k, rows)


def _q5_0(raw: np.ndarray, n: int, k: int, rows: np.ndarray | None) -> QuantWeight:
    """Q5_0: w = d * (q - 16), q 5 bits (low 4 in qs, element j's in byte j % 16, j < 16
    in the low nibble; the fifth in bit j of qh). As q8, exactly: codes 8 * (q - 16) in
    -128..120, scale d / 8."""
    blocks = raw.reshape(n * (k // GROUP), 22)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0] / 8
    qh = blocks[:, 2:6].copy().view("<u4")  # [blocks, 1]
    qs = blocks[:, 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [blocks, 32]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1
    q = low.astype(np.int16) | (high.astype(np.int16) << 4)
    codes = ((q - 16) * 8).astype(np.int8).reshape(n, k)
    return QuantWeight.pack("q8", torch.from_numpy(codes), torch.from_numpy(d.reshape(n, -1)), rows)
