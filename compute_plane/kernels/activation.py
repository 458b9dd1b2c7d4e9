"""SiLU(gate) * up over the fused gate|up projection's output, one launch.

Numerics as torch's `F.silu(gate) * up` in the model's dtype: SiLU in fp32 rounded to
the dtype, then the product in fp32 rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    a = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (a * u).to(ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I]: silu(gate) * up."""
    t, two = gate_up.shape
    assert two % 2 == 0 and gate_up.stride(1) == 1
    inter = two // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul[(t, triton.cdiv(inter, BLOCK))](
            gate_up, out, inter, gate_up.stride(0), BLOCK=BLOCK
        )
    return out
