"""Paged attention for prefill chunks: a chunk's queries over its cached prefix and itself.

The chunk's own K/V are written to the cache before this runs, so keys and values
all come through the block table. Query i of a chunk of q_len tokens in a sequence
of seq_len tokens sits at position prefix + i (prefix = seq_len - q_len) and sees
keys 0..prefix + i:

    keys      0 ............ prefix ........ seq_len
    query 0   ##############  #
    query 1   ##############  ##
    query 2   ##############  ###               (# = attended)

Grid: (chunk, BLOCK_M query tile, query head). A tile stops reading keys at its last
query's position, so the causal upper triangle is never loaded.

A bf16/fp16 cache feeds its values to both dots as they are (tensor cores at their
full rate: prefill is compute-bound), the scores and the softmax in fp32 and the
probabilities rounded to the values' dtype for the second dot, as FlashAttention
does. An fp32 cache runs IEEE fp32 dots; the interpreter (no GPU) runs bf16 in fp32,
as it computes bf16 wrongly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compute_plane.kernels import interpreted
from compute_plane.kernels.decode_attention import (
    dot_precision,
    load_paged_kv,
    native_dots,
    weigh_values,
)


@triton.jit
def _prefill(
    q_ptr,  # [T, H, D], the chunks back to back
    k_cache,  # [N, bs, KVH, D]
    v_cache,
    block_tables,  # [P, max_blocks] int32
    seq_lens,  # [P] int32
    q_start,  # [P + 1] int32: chunk p's queries are rows q_start[p] .. q_start[p + 1]
    out_ptr,  # [T, H, D]
    scale,
    window,  # > 0: query at position p sees keys p - window + 1 .. p only; 0: all
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kt,
    stride_kh,
    stride_vn,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE: tl.constexpr,  # dots on the cache's bf16/fp16 values, not on fp32 copies
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    first = tl.load(q_start + chunk)
    q_len = tl.load(q_start + chunk + 1) - first
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens + chunk)
    prefix = seq_len - q_len
    kvh = head // GROUP

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q_pos = prefix + m
    rows = (first + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if not NATIVE:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + chunk * stride_bt
    hi = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    lo = 0
    if window > 0:  # nothing before the tile's first query's window is read
        lo = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_paged_kv(
            k_cache, block, tok, kvh, d, stride_kn, stride_kt, stride_kh, kv_mask, NATIVE
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        seen = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if window > 0:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key of a tile yet (a window starts later for later rows):
        # exponents against 0 then, not -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_paged_kv(
            v_cache, block, tok, kvh, d, stride_vn, stride_vt, stride_vh, kv_mask, NATIVE
        )
        acc = acc * alpha[:, None] + weigh_values(p, v, DOT_PRECISION, NATIVE)
        m_i = m_new

    # Padding rows past q_len can see no key under a sliding window (l_i == 0); they are
    # never stored, but 0/0 on them is avoided as in the decode kernel.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [P, max_blocks] int32
    seq_lens: torch.Tensor,  # [P] int32: prefix + chunk length
    q_start: torch.Tensor,  # [P + 1] int32, q_start[0] == 0, q_start[P] == T
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int | None = None,
    native: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each chunk's queries over its paged prefix and itself (with a
    `window`, over the last `window` positions up to each query's own); [T, H, D].
    `native`: dots on bf16/fp16 values as they are (default: `native_dots`); False runs
    them on fp32 copies (a benchmark's comparison)."""
    t, h, d = q.shape
    if native is None:
        native = native_dots(k_cache.dtype)
    assert not native or q.dtype == k_cache.dtype == v_cache.dtype != torch.float32
    _, block_size, kvh, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert h % kvh == 0, f"{h} query heads do not group over {kvh} KV heads"
    if out is None:
        out = torch.empty_like(q)
    p = block_tables.shape[0]
    if t == 0 or p == 0:
        return out
    block_d = triton.next_power_of_2(d)
    if interpreted():
        block_m, block_n = 16, 16
    else:
        block_m, block_n = (64, 64) if block_d <= 128 else (64, 32)
    grid = (p, triton.cdiv(max_query_len, block_m), h)
    _prefill[grid](
        q, k_cache, v_cache, block_tables, seq_lens, q_start, out, scale, window or 0,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=h // kvh, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(k_cache.dtype),
        NATIVE=native,
    )  # fmt: skip
    return out
