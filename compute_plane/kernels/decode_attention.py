"""Paged attention for decode: one query token per sequence, split-K over the context.

Grid of the first kernel: (sequence, KV head, split). One program loads the query
rows of every head that shares its KV head (GQA/MQA: the group is padded to 16
rows so the scores are one `tl.dot`), walks its share of the context BLOCK_N tokens
at a time through the block table, and keeps an online softmax:

    context  [0 ........................................ seq_len)
    splits   [ split 0  )[ split 1  )[ split 2  )[ split 3 )      NUM_SPLITS = 4
    tiles     |BN|BN|BN|  |BN|BN|BN|  ...                          each split a multiple of BLOCK_N

With one split the program writes the output directly. With more (flash-decoding,
for long contexts and small batches, so enough programs fill the GPU) each split
writes its normalised partial output and log-sum-exp, and `_combine` merges them.
A split that starts past the end of a short sequence (a CUDA graph's split count is
chosen for the longest context it serves) returns at once, writing nothing, and the
combine reads only the splits that start before the end (`split_range`). Head dims
that are not powers of two (80, 96) are padded to BLOCK_D with masked lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from compute_plane.kernels import dependent_launch, interpreted


@triton.jit
def load_paged_native(cache, block, tok, kvh, d, stride_n, stride_t, stride_h, mask):
    """One KV head's rows [len(block), len(d)] of a paged cache, row i at slot tok[i] of
    block[i], in the cache's dtype."""
    ptrs = cache + block[:, None] * stride_n + tok[:, None] * stride_t + kvh * stride_h + d[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def load_paged_kv(
    cache, block, tok, kvh, d, stride_n, stride_t, stride_h, mask, NATIVE: tl.constexpr
):
    """`load_paged_native`, as fp32 unless NATIVE (the dots then take the cache's values;
    the interpreter computes bf16 wrongly, and the GPU keeps the same numerics)."""
    rows = load_paged_native(cache, block, tok, kvh, d, stride_n, stride_t, stride_h, mask)
    if not NATIVE:
        rows = rows.to(tl.float32)
    return rows


@triton.jit
def weigh_values(p, v, DOT_PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    """p @ v in fp32 sums; with NATIVE the probabilities rounded to the values' dtype first,
    as FlashAttention does, for the tensor cores' full rate."""
    if NATIVE:  # noqa: SIM108 (a constexpr branch: only one dot is compiled)
        pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    return pv


@triton.jit
def split_range(seq_len, window, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The context positions [lo, hi) of `split`, and how many splits are not empty: each
    split a whole number of BLOCK_N tiles, over the last `window` positions (0: all)."""
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)  # blocks before it are never read
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    live = tl.cdiv(seq_len - first, tl.maximum(per_split, 1))  # 0 for an empty context
    return lo, hi, live


@triton.jit
def _decode_split(
    q_ptr,  # [B, H, D]
    k_cache,  # [N, bs, KVH, D]
    v_cache,
    block_tables,  # [B, max_blocks] int32
    seq_lens,  # [B] int32
    out_ptr,  # [B, H, D] (NUM_SPLITS == 1) or partial outputs [B, H, NUM_SPLITS, D] fp32
    lse_ptr,  # [B, H, NUM_SPLITS] fp32 (unused when NUM_SPLITS == 1)
    scale,
    window,  # > 0: a sliding-window layer's, only the last `window` tokens; 0: all
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE: tl.constexpr,  # dots on the cache's bf16/fp16 values, not on fp32 copies
    PDL: tl.constexpr = False,  # a programmatic dependent launch (kernels.set_dependent_launch)
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)  # (staged by the host: no kernel of the step writes it)
    lo, hi, live = split_range(seq_len, window, split, NUM_SPLITS, BLOCK_N)
    if NUM_SPLITS > 1 and split >= live:
        return  # past the end: the combine reads nothing of this split
    if PDL:  # q and the step's K/V are the kernel before's writes
        gdc_wait()
        gdc_launch_dependents()

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if not NATIVE:  # (natively the scores are scaled after the dot, in fp32)
        q = q.to(tl.float32) * scale

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_paged_kv(
            k_cache, block, tok, kvh, d, stride_kn, stride_kt, stride_kh, kv_mask, NATIVE
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N], fp32
        if NATIVE:  # (else q was scaled before the dot)
            s = s * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_paged_kv(
            v_cache, block, tok, kvh, d, stride_vn, stride_vt, stride_vh, kv_mask, NATIVE
        )
        acc = acc * alpha[:, None] + weigh_values(p, v, DOT_PRECISION, NATIVE)
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs + split * stride_os, out, mask=o_mask)
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(
            lse_ptr + (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split,
            lse,
            mask=g_mask,
        )


@triton.jit
def _combine(
    part_ptr,  # [B, H, NUM_SPLITS, D] fp32
    lse_ptr,  # [B, H, NUM_SPLITS] fp32
    out_ptr,  # [B, H, D]
    seq_lens,  # [B] int32
    window,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the split kernel's
    PDL: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)  # (staged by the host, as in the split kernel)
    _, _, live = split_range(seq_len, window, 0, NUM_SPLITS, BLOCK_N)
    if PDL:  # the partials are the split kernel's writes; nothing else is read above
        gdc_wait()
        gdc_launch_dependents()
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < live  # the splits past the end wrote nothing
    lse = tl.load(
        lse_ptr + (seq * NUM_HEADS + head) * NUM_SPLITS + s, mask=s_mask, other=float("-inf")
    )
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # only a zero-length sequence has no split
    w = tl.exp(lse - top)
    total = tl.sum(w, 0)
    w = w / tl.where(total > 0.0, total, 1.0)
    parts = tl.load(
        part_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches need IEEE dots; bf16/fp16 values are exact in tf32, so tensor cores serve."""
    return "ieee" if dtype == torch.float32 else "tf32"


def native_dots(dtype: torch.dtype) -> bool:
    """Whether the attention dots take the cache's values as they are (bf16/fp16 operands,
    fp32 sums; the probabilities rounded to the cache's dtype for the second dot, as in
    FlashAttention) rather than fp32 copies in tf32 dots: bf16/fp16, except bf16 in the
    interpreter, which computes it wrongly."""
    if dtype == torch.bfloat16:
        return not interpreted()
    return dtype == torch.float16


def context_tile(block_d: int) -> int:
    """BLOCK_N: the context positions a program reads at a time (each split a multiple)."""
    # Interpreted programs cost per op, not per lane: wider tiles finish sooner there.
    return 16 if interpreted() else (64 if block_d <= 128 else 32)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough programs to fill the GPU twice over, but at least 256 tokens per split."""
    if num_sms <= 0:
        return 1
    by_length = triton.cdiv(max_seq_len, 256)
    by_occupancy = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    return max(1, min(by_length, by_occupancy, 64))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [N, bs, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    window: int | None = None,
    native: bool | None = None,
) -> torch.Tensor:
    """softmax(q·Kᵀ·scale)·V over each sequence's first seq_len cached tokens (with a
    `window`, only the last `window` of them); returns [B, H, D].

    Reads only; the caller has written the new token's K/V into the cache already.
    `num_splits` > 1 splits each context (or window) into that many parts (flash-decoding).
    `native`: dots on bf16/fp16 values as they are (default: `native_dots`); False runs
    them on fp32 copies (as before 2026-11-26; a benchmark's comparison).
    """
    if native is None:
        native = native_dots(k_cache.dtype)
    assert not native or q.dtype == k_cache.dtype == v_cache.dtype != torch.float32
    b, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert h % kvh == 0, f"{h} query heads do not group over {kvh} KV heads"
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    group = h // kvh
    block_d = triton.next_power_of_2(d)
    block_g = max(16, triton.next_power_of_2(group))
    block_n = context_tile(block_d)
    common: dict[str, object] = dict(
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        NATIVE=native,
        **dependent_launch(),
    )
    kv_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if num_splits == 1:
        _decode_split[(b, kvh, 1)](
            q, k_cache, v_cache, block_tables, seq_lens, out, out, scale, window or 0,
            q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
            out.stride(0), out.stride(1), 0, **common,
        )  # fmt: skip
        return out
    parts = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    _decode_split[(b, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, parts, lse, scale, window or 0,
        q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), **common,
    )  # fmt: skip
    _combine[(b, h)](
        parts, lse, out, seq_lens, window or 0, parts.stride(0), parts.stride(1),
        parts.stride(2), out.stride(0), out.stride(1),
        NUM_HEADS=h, HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_N=block_n, **dependent_launch(),
    )  # fmt: skip
    return out
