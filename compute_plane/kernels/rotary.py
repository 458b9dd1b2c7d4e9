"""Rotary position embedding (Hugging Face `rotate_half` layout), one program per token.

For each head, with x = [x1 | x2] split at half the head dim and the tables'
first half c, s at the token's position:  out = [x1·c − x2·s | x2·c + x1·s].

`apply_rotary` rotates q and k in one launch, given norm weights after RMS-normalising
each head (Qwen3's q/k norm) with `rms_norm`'s roundings: one kernel where there were
four.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _heads(
    x_ptr,  # the token's first head
    stride_h,
    out_ptr,  # the token's first head in the output (contiguous heads)
    num_heads,
    w_ptr,  # the per-head norm weight [D] (HAS_NORM)
    eps,
    c,
    s,
    i,
    i_mask,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < num_heads) & i_mask[None, :]
    base = x_ptr + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    if HAS_NORM:  # as rms_norm: normalise in fp32, round, scale by the weight, round
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * r).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        x2 = ((x2 * r).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
    dst = out_ptr + h[:, None] * (2 * HALF) + i[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(ty), mask=mask)


@triton.jit
def _qk_rotary(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    q_out,  # [T, H, D] contiguous
    k_out,  # [T, KVH, D] contiguous
    positions,  # [T]
    cos_ptr,  # [max_pos, D]
    sin_ptr,
    qw_ptr,  # q / k norm weights [D] (HAS_NORM)
    kw_ptr,
    eps,
    num_q,
    num_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    _heads(
        q_ptr + t * stride_qt, stride_qh, q_out + t * num_q * (2 * HALF), num_q, qw_ptr, eps,
        c, s, i, i_mask, HALF, BLOCK_Q, HAS_NORM,
    )  # fmt: skip
    _heads(
        k_ptr + t * stride_kt, stride_kh, k_out + t * num_k * (2 * HALF), num_k, kw_ptr, eps,
        c, s, i, i_mask, HALF, BLOCK_K, HAS_NORM,
    )  # fmt: skip


def apply_rotary(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_pos, D]
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,  # [D]: RMS-normalise each head first (Qwen3)
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (contiguous), each token by its position's angles, in one
    launch; with norm weights, rotary(rms_norm(q, q_weight), rms_norm(k, k_weight))."""
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape == (t, kvh, d) and d % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert cos.stride(1) == 1 and cos.stride() == sin.stride()
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, kvh, d), dtype=k.dtype, device=k.device)
    if t:
        norm = q_weight is not None and k_weight is not None
        _qk_rotary[(t,)](
            q, k, q_out, k_out, positions, cos, sin,
            q_weight if norm else cos, k_weight if norm else cos, eps, h, kvh,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            HALF=d // 2, BLOCK_Q=triton.next_power_of_2(h), BLOCK_K=triton.next_power_of_2(kvh),
            BLOCK_HALF=triton.next_power_of_2(d // 2), HAS_NORM=norm,
        )  # fmt: skip
    return q_out, k_out
