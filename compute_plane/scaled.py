"""FP8 and INT8 weights for GPU-style (bf16/fp16) serving: `--quantization fp8|int8`.

A `ScaledWeight` is a [N, K] matrix of 8-bit values with one fp32 scale per output
channel (w = scale[n] * data[n, k]), the layout vLLM's "fp8" checkpoints use per channel
(a per-tensor scale is the same scale for every channel):

  fp8 (e4m3): the activations are quantized per token (row) to e4m3 at each call, and
      `torch._scaled_mm` multiplies the two in FP8 with fp32 accumulation, scaling rows
      and columns on the way out: the tensor cores' FP8 rate on GPUs that have it (CUDA
      compute capability 8.9+: Ada, Hopper); torch runs the same op on the CPU, which is
      what the CPU tests check. Elsewhere the weight is stored as weight-only INT8.
  int8: weight-only, activations stay in the model's dtype; `torch._weight_int8pack_mm`
      where this torch has it for the device, else the weight is scaled up to the
      activations' dtype at each call (half the memory of bf16 either way).

On the CPU in float32 `--quantization int8` keeps its own layout (compute_plane/quant.py,
groups of 32 on the C kernels); this module is for the other devices and dtypes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALED_KINDS = ("fp8", "int8")


@dataclass(frozen=True)
class ScaledWeight:
    kind: str  # fp8 | int8
    data: torch.Tensor  # [N, K] float8_e4m3fn or int8
    scale: torch.Tensor  # [N] fp32: w[n] = scale[n] * data[n]

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        return int(n), int(k)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def to(self, device: torch.device) -> ScaledWeight:
        return ScaledWeight(self.kind, self.data.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale[:, None]).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ w.T (+ bias) in x's dtype."""
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if self.kind == "fp8":
            y = _fp8_mm(x2, self.data, self.scale)
        elif _int8pack_works(x2.device, x2.dtype):
            y = torch._weight_int8pack_mm(x2.contiguous(), self.data, self.scale.to(x2.dtype))
        else:
            y = x2 @ (self.data.to(x2.dtype) * self.scale[:, None].to(x2.dtype)).T
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], n)


def quantize_fp8(w: torch.Tensor) -> ScaledWeight:
    """Dense [N, K] -> e4m3 with a scale per output channel (absmax / 448)."""
    w32 = w.detach().to(torch.float32)
    scale = (w32.abs().amax(1) / FP8_MAX).clamp_min(1e-12)
    data = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return ScaledWeight("fp8", data.contiguous(), scale.contiguous())


def quantize_int8(w: torch.Tensor) -> ScaledWeight:
    """Dense [N, K] -> int8 with a scale per output channel (symmetric, absmax / 127)."""
    w32 = w.detach().to(torch.float32)
    scale = (w32.abs().amax(1) / 127.0).clamp_min(1e-12)
    data = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return ScaledWeight("int8", data.contiguous(), scale.contiguous())


def from_fp8(data: torch.Tensor, scale: torch.Tensor) -> ScaledWeight | None:
    """A checkpoint's e4m3 matrix with a per-tensor or per-output-channel scale, kept
    as it is (exactly); None for other scale layouts (block-wise: the caller
    dequantizes those)."""
    n = data.shape[0]
    s = scale.to(torch.float32).reshape(-1)
    if s.numel() == 1:
        s = s.expand(n)
    elif s.numel() != n:
        return None
    return ScaledWeight("fp8", data.contiguous(), s.contiguous().clone())


@functools.cache
def fp8_supported(device: torch.device) -> bool:
    """Whether FP8 matmuls with per-row and per-column scales run here: CUDA compute
    capability 8.9+ (checked by a tiny product), or the CPU (torch's reference
    implementation, for tests). Called when weights are placed, never in a CUDA graph."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return False
    if device.type not in ("cuda", "cpu"):
        return False
    try:
        w = quantize_fp8(torch.eye(16, 32, device=device))
        out = _fp8_mm(torch.ones(2, 32, device=device, dtype=torch.bfloat16), w.data, w.scale)
        ok = bool(torch.allclose(out.float().cpu(), torch.ones(2, 16)))
    except (RuntimeError, NotImplementedError) as e:
        log.warning("FP8 matmuls unavailable on %s (%s): FP8 weights run as INT8", device, e)
        return False
    return ok


def prepare_device(w: ScaledWeight, device: torch.device, dtype: torch.dtype) -> None:
    """Run the probes w's linear relies on now (at placement), not in a CUDA graph."""
    if w.kind == "int8":
        _int8pack_works(device, dtype)


def quantize(w: torch.Tensor, kind: str, device: torch.device) -> ScaledWeight:
    """Dense -> `kind` (fp8 where this device multiplies FP8, else int8)."""
    if kind == "fp8" and fp8_supported(device):
        return quantize_fp8(w)
    return quantize_int8(w)


def reencode(w: ScaledWeight, device: torch.device) -> ScaledWeight:
    """An fp8 weight on a device without FP8 matmuls becomes int8 (weight-only)."""
    if w.kind == "fp8" and not fp8_supported(device):
        return quantize_int8(w.dequantize())
    return w


def _fp8_mm(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (scale * data).T with x quantized per row to e4m3."""
    x32 = x.to(torch.float32)
    sx = (x32.abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [M, 1]
    xq = (x32 / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    y = torch._scaled_mm(xq, data.t(), scale_a=sx, scale_b=scale[None, :], out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


@functools.cache
def _int8pack_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._weight_int8pack_mm runs for this device and dtype (a tiny probe)."""
    try:
        out = torch._weight_int8pack_mm(
            torch.ones(1, 32, dtype=dtype, device=device),
            torch.ones(16, 32, dtype=torch.int8, device=device),
            torch.full((16,), 0.5, dtype=dtype, device=device),
        )
        ok = bool(torch.allclose(out.float().cpu(), torch.full((1, 16), 16.0)))
    except (RuntimeError, NotImplementedError) as e:
        log.info("torch._weight_int8pack_mm unavailable on %s %s (%s)", device, dtype, e)
        return False
    return ok
