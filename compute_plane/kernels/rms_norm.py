"""Fused RMSNorm, optionally after a residual add, one program per row.

Numerics follow Hugging Face Llama, as the torch path does: the sum x + residual
is rounded to the model dtype (it is the new residual stream), normalised in fp32,
rounded again, then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from compute_plane.kernels import dependent_launch


@triton.jit
def _rms_norm(
    x_ptr,
    res_ptr,  # residual in, or x itself when HAS_RESIDUAL is false
    w_ptr,
    out_ptr,
    res_out_ptr,  # x + residual, written when HAS_RESIDUAL
    eps,
    inner,  # rows are (outer, inner) pairs, so [T, H, D] head views need no copy
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,  # a programmatic dependent launch (kernels.set_dependent_launch)
):
    if PDL:  # the rows are the kernel before's outputs; nothing is read or written above
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    sub = row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + outer * stride_x0 + sub * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * stride_r0 + sub * stride_r1 + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row.to(tl.int64) * N + cols, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row.to(tl.int64) * N + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, inner, stride of outer, stride of inner) of a 2-D or 3-D tensor with unit last stride."""
    assert x.stride(-1) == 1, "the normalised dimension must be contiguous"
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    assert x.dim() == 3, f"expected [T, N] or [T, H, N], got {tuple(x.shape)}"
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of [T, N] or [T, H, N]; returns a contiguous tensor."""
    rows, inner, s0, s1 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        n = x.shape[-1]
        _rms_norm[(rows,)](
            x, x, weight, out, out, eps, inner, s0, s1, 0, 0,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=False, **dependent_launch(),
        )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for [T, N] inputs, in one pass over memory."""
    assert x.shape == residual.shape and x.dim() == 2
    rows, inner, s0, s1 = _rows(x)
    _, _, r0, r1 = _rows(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    if rows:
        n = x.shape[-1]
        _rms_norm[(rows,)](
            x, residual, weight, out, summed, eps, inner, s0, s1, r0, r1,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=True, **dependent_launch(),
        )  # fmt: skip
    return out, summed
