"""Rotary position embedding (Hugging Face `rotate_half` layout), one program per token.

For each head, with x = [x1 | x2] split at half the head dim and the tables'
first half c, s at the token's position:  out = [x1·c − x2·s | x2·c + x1·s].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary(
    x_ptr,  # [T, H, D]
    out_ptr,  # [T, H, D] contiguous
    positions,  # [T]
    cos_ptr,  # [max_pos, D] (both halves equal; the first is read)
    sin_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_cos,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(positions + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    mask = (h[:, None] < num_heads) & i_mask[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    base = x_ptr + t.to(tl.int64) * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (t.to(tl.int64) * num_heads + h[:, None]) * (2 * HALF) + i[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * c - x2 * s).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(ty), mask=mask)


def _apply(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    t, h, d = x.shape
    assert x.stride(2) == 1 and d % 2 == 0 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _rotary[(t,)](
            x, out, positions, cos, sin, h, x.stride(0), x.stride(1), cos.stride(0),
            HALF=d // 2, BLOCK_H=triton.next_power_of_2(h),
            BLOCK_HALF=triton.next_power_of_2(d // 2),
        )  # fmt: skip
    return out


def apply_rotary(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_pos, D]
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (contiguous), each token by its position's angles."""
    return _apply(q, positions, cos, sin), _apply(k, positions, cos, sin)
