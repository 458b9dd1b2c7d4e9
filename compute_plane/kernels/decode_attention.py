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
A split that starts past the end of a short sequence writes lse = -inf and counts
for nothing. Head dims that are not powers of two (80, 96) are padded to BLOCK_D
with masked lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from compute_plane.kernels import dependent_launch, interpreted
from compute_plane.kernels.rotary import rotate_halves


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
def _side_by_side(x1, x2):
    """[R, W] halves -> [R, 2W] rows: x1's lanes, then x2's."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (x1.shape[0], 2 * x1.shape[1]))


@triton.jit
def _softmax_tile(q, k, v, n_mask, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr,
                  NATIVE: tl.constexpr):  # fmt: skip
    """The online softmax over one tile of keys and values: (max, sum, output) updated."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N], fp32
    if NATIVE:  # (else q was scaled before the dot)
        s = s * scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + weigh_values(p, v, DOT_PRECISION, NATIVE)
    return m_new, l_i, acc


@triton.jit
def _decode_split(
    q_ptr,  # [B, H, D] (ROTATE: before its rotation, a view into q|k|v)
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
    tickets,  # [B * KVH] int32, zero between launches (FOLD)
    final_ptr,  # [B, H, D]: the merged output (FOLD)
    stride_fb,
    stride_fh,
    k_new,  # [B, KVH, D] the step's K before its rotation (ROTATE; a view into q|k|v)
    v_new,  # [B, KVH, D] its V, with k_new's strides
    stride_nb,
    stride_nh,
    positions,  # [B] (ROTATE)
    slots,  # [B] int64: where the step's K/V go in the caches (ROTATE)
    cos_ptr,  # [max_pos, D] (ROTATE)
    sin_ptr,
    stride_cos,
    qw_ptr,  # q / k norm weights [D] (HAS_NORM)
    kw_ptr,
    eps,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE: tl.constexpr,  # dots on the cache's bf16/fp16 values, not on fp32 copies
    FOLD: tl.constexpr = False,  # the last split of each (sequence, KV head) merges them
    BLOCK_S: tl.constexpr = 1,  # (FOLD) NUM_SPLITS padded to a power of two
    ROTATE: tl.constexpr = False,  # rotate q, and the step's K/V into the caches, here
    HAS_NORM: tl.constexpr = False,  # (ROTATE) each head RMS-normalised first (Qwen3)
    PDL: tl.constexpr = False,  # a programmatic dependent launch (kernels.set_dependent_launch)
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)  # (staged by the host: no kernel of the step writes it)
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)  # blocks before it are never read
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    lane = tl.arange(0, BLOCK_D)
    if ROTATE:  # the halves apart: lane i < BLOCK_D/2 is dim i, lane BLOCK_D/2 + i dim D/2 + i
        d = tl.where(lane < BLOCK_D // 2, lane, HEAD_DIM // 2 + lane - BLOCK_D // 2)
        d_mask = (lane % (BLOCK_D // 2)) < HEAD_DIM // 2
    else:
        d = lane
        d_mask = lane < HEAD_DIM
    table = block_tables + seq * stride_bt
    n0 = lo + tl.arange(0, BLOCK_N)
    n0_mask = n0 < hi
    if ROTATE:  # the first tile before the wait: no kernel of this layer before writes a cache
        block0 = tl.load(table + n0 // BLOCK_SIZE, mask=n0_mask, other=0).to(tl.int64)
        tok0 = n0 % BLOCK_SIZE
        kv0_mask = n0_mask[:, None] & d_mask[None, :]
        k0 = load_paged_kv(
            k_cache, block0, tok0, kvh, d, stride_kn, stride_kt, stride_kh, kv0_mask, NATIVE
        )
        v0 = load_paged_kv(
            v_cache, block0, tok0, kvh, d, stride_vn, stride_vt, stride_vh, kv0_mask, NATIVE
        )
    if PDL:  # q (and the step's K/V) are the kernel before's writes
        gdc_wait()
        gdc_launch_dependents()
    if ROTATE:
        ty = k_cache.dtype.element_ty
        pos = tl.load(positions + seq).to(tl.int64)
        i = tl.arange(0, BLOCK_D // 2)
        i_mask = i < HEAD_DIM // 2
        c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)
        qm = g_mask[:, None] & i_mask[None, :]
        qb = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + i[None, :]
        x1 = tl.load(qb, mask=qm, other=0.0).to(tl.float32)
        x2 = tl.load(qb + HEAD_DIM // 2, mask=qm, other=0.0).to(tl.float32)
        o1, o2 = rotate_halves(
            x1, x2, qw_ptr, eps, c[None, :], sn[None, :], i, i_mask, ty, HEAD_DIM // 2, HAS_NORM
        )
        q = _side_by_side(o1, o2)
        new = seq_len - 1
        if (lo <= new) & (new < hi):  # this split holds the step's token: its K/V go in
            kb = k_new + seq * stride_nb + kvh * stride_nh + i[None, :]
            k1 = tl.load(kb, mask=i_mask[None, :], other=0.0).to(tl.float32)
            k2 = tl.load(kb + HEAD_DIM // 2, mask=i_mask[None, :], other=0.0).to(tl.float32)
            r1, r2 = rotate_halves(
                k1, k2, kw_ptr, eps, c[None, :], sn[None, :], i, i_mask, ty, HEAD_DIM // 2,
                HAS_NORM,
            )  # fmt: skip
            kr = _side_by_side(r1, r2)  # [1, BLOCK_D]
            vb = v_new + seq * stride_nb + kvh * stride_nh + d[None, :]
            vr = tl.load(vb, mask=d_mask[None, :], other=0.0).to(tl.float32).to(ty)
            slot = tl.load(slots + seq).to(tl.int64)
            blk, tk = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            at_k = k_cache + blk * stride_kn + tk * stride_kt + kvh * stride_kh + d[None, :]
            at_v = v_cache + blk * stride_vn + tk * stride_vt + kvh * stride_vh + d[None, :]
            tl.store(at_k, kr, mask=d_mask[None, :])
            tl.store(at_v, vr, mask=d_mask[None, :])
            here = (n0 == new)[:, None]  # the first tile, read before it was written
            k0 = tl.where(here, kr.to(k0.dtype), k0)
            v0 = tl.where(here, vr.to(v0.dtype), v0)
            tl.debug_barrier()  # a later tile of this split reads the row from the cache
    else:
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
    start0 = lo
    if ROTATE:
        if lo < hi:  # (an empty split's tile would make -inf - -inf)
            m_i, l_i, acc = _softmax_tile(
                q, k0, v0, n0_mask, m_i, l_i, acc, scale, DOT_PRECISION, NATIVE
            )
        start0 = lo + BLOCK_N
    for start in range(start0, hi, BLOCK_N):
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
        if FOLD:  # the split that finishes last merges the group's heads (no _combine launch)
            tl.debug_barrier()  # every thread's stores above, before the count is taken
            ticket = tickets + seq * tl.num_programs(1) + kvh
            if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                for j in tl.static_range(GROUP):
                    _merge(
                        out_ptr, lse_ptr, final_ptr, seq, kvh * GROUP + j, stride_ob,
                        stride_oh, stride_os, stride_fb, stride_fh,
                        tl.num_programs(1) * GROUP, HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S,
                        ".cg",
                    )  # fmt: skip
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # for the next launch


@triton.jit
def _merge(
    part_ptr, lse_ptr, out_ptr, seq, head, stride_pb, stride_ph, stride_ps, stride_ob,
    stride_oh, num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """One head's output: its splits' partial outputs weighed by their share of the
    softmax (exp(lse - max), normalised). CACHE: the loads' cache modifier ("" or ".cg":
    past the SM's L1, for partials other programs wrote during this launch)."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    lse = tl.load(
        lse_ptr + (seq * num_heads + head) * NUM_SPLITS + s,
        mask=s_mask,
        other=float("-inf"),
        cache_modifier=CACHE,
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
        cache_modifier=CACHE,
    )
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit
def _combine(
    part_ptr,  # [B, H, NUM_SPLITS, D] fp32
    lse_ptr,  # [B, H, NUM_SPLITS] fp32
    out_ptr,  # [B, H, D]
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
    PDL: tl.constexpr = False,
):
    if PDL:  # the partials are the split kernel's writes; nothing is read or written above
        gdc_wait()
        gdc_launch_dependents()
    _merge(
        part_ptr, lse_ptr, out_ptr, tl.program_id(0), tl.program_id(1), stride_pb, stride_ph,
        stride_ps, stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S, "",
    )  # fmt: skip


class Fold:
    """Whether decode attention over several splits merges them in its last split
    (`paged_decode_attention`'s `fold`; `benchmarks.gpu` times both ways)."""

    combine = True


# Each device's (and CUDA stream's) tickets: a count per (sequence, KV head) of the splits
# done, which the last one sets back to zero. Allocated before any graph is captured (a
# capture's warm-up forward runs first, largest batch first) and kept: graphs use them.
_TICKETS: dict[tuple[str, int], torch.Tensor] = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    have = _TICKETS.get(key)
    if have is None or have.numel() < n:
        have = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _TICKETS[key] = have
    return have


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


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough programs to fill the GPU twice over, but at least 256 tokens per split."""
    if num_sms <= 0:
        return 1
    by_length = triton.cdiv(max_seq_len, 256)
    by_occupancy = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    return max(1, min(by_length, by_occupancy, 64))


@dataclass(frozen=True)
class StepRotation:
    """What `rotate_and_attend` rotates and stores: the step's K/V before rotation, where
    they go, and the rotation's tables (and per-head norm weights, Qwen3)."""

    k: torch.Tensor  # [B, KVH, D] (a view into q|k|v)
    v: torch.Tensor  # [B, KVH, D], k's strides
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] int64
    cos: torch.Tensor  # [max_pos, D]
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None  # [D]
    k_weight: torch.Tensor | None = None
    eps: float = 0.0


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
    fold: bool | None = None,
    rotation: StepRotation | None = None,
) -> torch.Tensor:
    """softmax(q·Kᵀ·scale)·V over each sequence's first seq_len cached tokens (with a
    `window`, only the last `window` of them); returns [B, H, D].

    Reads only; the caller has written the new token's K/V into the cache already
    (unless `rotation`: see `rotate_and_attend`).
    `num_splits` > 1 splits each context (or window) into that many parts (flash-decoding).
    `native`: dots on bf16/fp16 values as they are (default: `native_dots`); False runs
    them on fp32 copies (as before 2026-11-26; a benchmark's comparison).
    `fold` (with splits): the split of each (sequence, KV head) that finishes last merges
    the partial outputs, counted by an atomic ticket, instead of a `_combine` launch after
    (default: `Fold.combine`); the same arithmetic either way.
    """
    if native is None:
        native = native_dots(k_cache.dtype)
    assert not native or q.dtype == k_cache.dtype == v_cache.dtype != torch.float32
    b, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert h % kvh == 0, f"{h} query heads do not group over {kvh} KV heads"
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group = h // kvh
    block_d = triton.next_power_of_2(d)
    block_g = max(16, triton.next_power_of_2(group))
    # Interpreted programs cost per op, not per lane: wider tiles finish sooner there.
    block_n = 16 if interpreted() else (64 if block_d <= 128 else 32)
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
    r = rotation
    if r is None:  # (the rotation's arguments: unused)
        rotating: tuple[object, ...] = (q, q, 0, 0, seq_lens, seq_lens, q, q, 0, q, q, 0.0)
    else:
        assert d % 2 == 0 and r.k.shape == r.v.shape == (b, kvh, d)
        assert r.k.stride() == r.v.stride() and r.k.stride(2) == 1
        assert r.slots.dtype == torch.int64 and r.cos.stride(1) == 1
        assert r.cos.stride() == r.sin.stride()
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
        norm = r.q_weight is not None and r.k_weight is not None
        rotating = (
            r.k, r.v, r.k.stride(0), r.k.stride(1), r.positions, r.slots, r.cos, r.sin,
            r.cos.stride(0), r.q_weight if norm else r.cos, r.k_weight if norm else r.cos, r.eps,
        )  # fmt: skip
        common |= {"ROTATE": True, "HAS_NORM": norm}
    kv_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if num_splits == 1:
        _decode_split[(b, kvh, 1)](
            q, k_cache, v_cache, block_tables, seq_lens, out, out, scale, window or 0,
            q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
            out.stride(0), out.stride(1), 0, out, out, 0, 0, *rotating, **common,
        )  # fmt: skip
        return out
    parts = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    block_s = triton.next_power_of_2(num_splits)
    if Fold.combine if fold is None else fold:
        _decode_split[(b, kvh, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, parts, lse, scale, window or 0,
            q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
            parts.stride(0), parts.stride(1), parts.stride(2), _tickets(q.device, b * kvh),
            out, out.stride(0), out.stride(1), *rotating, FOLD=True, BLOCK_S=block_s,
            **common,
        )  # fmt: skip
        return out
    _decode_split[(b, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, parts, lse, scale, window or 0,
        q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse, out, 0, 0, *rotating,
        **common,
    )  # fmt: skip
    _combine[(b, h)](
        parts, lse, out, parts.stride(0), parts.stride(1), parts.stride(2),
        out.stride(0), out.stride(1),
        NUM_HEADS=h, HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=block_s, **dependent_launch(),
    )  # fmt: skip
    return out


def rotate_and_attend(
    q: torch.Tensor,  # [B, H, D] before its rotation (a view into q|k|v)
    k_cache: torch.Tensor,  # [N, bs, KVH, D] contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    rotation: StepRotation,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    window: int | None = None,
    native: bool | None = None,
    fold: bool | None = None,
) -> torch.Tensor:
    """A decode step's attention with its rotation in the same launch: each program
    rotates its heads of q (`rotary.apply_rotary`'s arithmetic, the per-head norm first
    where given), and the split that holds a sequence's new token (its last, at
    seq_len - 1) rotates that token's K, stores it and V at its slot of the caches
    (`rotary.rotate_into_cache`'s write) and attends with them. With no earlier kernel
    of the layer writing the caches, every split reads its first tile of K/V before it
    waits for the kernel before (with `--pdl`). Each sequence must be one request's only
    row in the step: a row can see no other row's new K/V (a proposal's k + 1 rows take
    `rotate_into_cache`, then `paged_decode_attention`)."""
    return paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out, window, native,
        fold, rotation,
    )  # fmt: skip
