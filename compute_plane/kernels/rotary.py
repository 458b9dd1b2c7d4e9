"""Rotary position embedding (Hugging Face `rotate_half` layout), one program per token.

For each head, with x = [x1 | x2] split at half the head dim and the tables'
first half c, s at the token's position:  out = [x1·c − x2·s | x2·c + x1·s].

`apply_rotary` rotates q and k in one launch, given norm weights after RMS-normalising
each head (Qwen3's q/k norm) with `rms_norm`'s roundings: one kernel where there were
four. `rotate_into_cache` is the same kernel storing the rotated k, and v as it is,
straight into the paged KV cache at each token's slot: the KV write's own kernel (and
k's round trip through memory) is gone too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from compute_plane.kernels import dependent_launch


@triton.jit
def _heads(
    x_ptr,  # the token's first head
    stride_h,
    out_ptr,  # the token's first head in the output (contiguous heads)
    num_heads,
    w1,  # the per-head norm weight's halves [1, BLOCK_HALF] fp32 (HAS_NORM)
    w2,
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
    k_out,  # [T, KVH, D] contiguous, or the K cache [N, bs, KVH, D] (WRITE_CACHE)
    v_ptr,  # [T, KVH, D] (WRITE_CACHE)
    v_cache,  # [N, bs, KVH, D] (WRITE_CACHE)
    slots,  # [T] int64: each token's slot in the caches (WRITE_CACHE)
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
    stride_vt,
    stride_vh,
    stride_cos,
    HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    PDL: tl.constexpr = False,  # a programmatic dependent launch (kernels.set_dependent_launch)
):
    # Read before the wait: the step's positions and slots (staged by the host before the
    # step; no kernel writes them), the angle tables and the norm weights (the model's)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    # a token's K/V rows are contiguous heads both in k_out and at a cache slot
    row = tl.load(slots + t).to(tl.int64) if WRITE_CACHE else t
    qw1, qw2, kw1, kw2 = c, c, c, c  # (unused without the norm)
    if HAS_NORM:
        qw1 = tl.load(qw_ptr + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(qw_ptr + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(kw_ptr + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(kw_ptr + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    if PDL:  # q, k and v are the kernel before's outputs; nothing is written above
        gdc_wait()
        gdc_launch_dependents()
    _heads(
        q_ptr + t * stride_qt, stride_qh, q_out + t * num_q * (2 * HALF), num_q, qw1, qw2, eps,
        c, s, i, i_mask, HALF, BLOCK_Q, HAS_NORM,
    )  # fmt: skip
    _heads(
        k_ptr + t * stride_kt, stride_kh, k_out + row * num_k * (2 * HALF), num_k, kw1, kw2,
        eps, c, s, i, i_mask, HALF, BLOCK_K, HAS_NORM,
    )  # fmt: skip
    if WRITE_CACHE:  # v unchanged, a half-row at a time (fp32 holds every 16-bit value)
        h = tl.arange(0, BLOCK_K)
        mask = (h[:, None] < num_k) & i_mask[None, :]
        src = v_ptr + t * stride_vt + h[:, None] * stride_vh + i[None, :]
        dst = v_cache + row * num_k * (2 * HALF) + h[:, None] * (2 * HALF) + i[None, :]
        ty = v_cache.dtype.element_ty
        tl.store(dst, tl.load(src, mask=mask, other=0.0).to(tl.float32).to(ty), mask=mask)
        v2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + HALF, v2.to(ty), mask=mask)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_out: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # v, v_cache, slots
) -> torch.Tensor:
    """The rotated q (contiguous); k rotated into k_out (rows, or cache slots)."""
    t, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape == (t, kvh, d) and d % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert cos.stride(1) == 1 and cos.stride() == sin.stride()
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if not t:
        return q_out
    norm = q_weight is not None and k_weight is not None
    v, v_cache, slots = cache if cache is not None else (k, k_out, positions)
    _qk_rotary[(t,)](
        q, k, q_out, k_out, v, v_cache, slots, positions, cos, sin,
        q_weight if norm else cos, k_weight if norm else cos, eps, h, kvh,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        HALF=d // 2, BLOCK_Q=triton.next_power_of_2(h), BLOCK_K=triton.next_power_of_2(kvh),
        BLOCK_HALF=triton.next_power_of_2(d // 2), HAS_NORM=norm, WRITE_CACHE=cache is not None,
        **dependent_launch(),
    )  # fmt: skip
    return q_out


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
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _launch(q, k, positions, cos, sin, q_weight, k_weight, eps, k_out, None), k_out


def rotate_into_cache(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D], last dim contiguous (a view into the qkv output)
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_pos, D]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [N, bs, KVH, D] contiguous
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64 (padding tokens write to the null block's slots)
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """`apply_rotary`'s q, with its k (rotated) and v stored at their slots of the caches
    (`cache_ops.write_kv`'s scatter) by the same launch instead of returned."""
    kvh, d = k.shape[1], k.shape[2]
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k_cache.shape[2:] == (kvh, d) and v_cache.shape == k_cache.shape
    assert v.shape == k.shape and v.stride(2) == 1 and slots.dtype == torch.int64
    assert k_cache.dtype == v_cache.dtype == k.dtype == v.dtype
    cache = (v, v_cache, slots)
    return _launch(q, k, positions, cos, sin, q_weight, k_weight, eps, k_cache, cache)
