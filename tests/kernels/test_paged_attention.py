"""Paged-attention kernels against a float64 reference over the same paged cache."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.reference import DEVICE, DTYPES, TOL, PagedCache, attend

pytest.importorskip("triton")

from compute_plane.kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
)
from compute_plane.kernels.prefill_attention import paged_prefill_attention

# (query heads, KV heads, head dim, block size, context lengths, splits).
# Lengths cover 1, a partial last block and an exact block boundary.
DECODE_CASES = [
    pytest.param(4, 4, 64, 16, [1, 16, 23], 1, id="mha-d64-bs16"),
    pytest.param(8, 2, 80, 8, [8, 13, 1], 1, id="gqa4-d80-bs8"),
    pytest.param(14, 2, 128, 32, [32, 45, 1], 1, id="gqa7-d128-bs32"),
    pytest.param(4, 1, 64, 16, [33, 2], 1, id="mqa-d64-bs16"),
    pytest.param(8, 2, 80, 8, [40, 3, 17], 3, id="gqa4-d80-bs8-split3"),
    pytest.param(4, 1, 128, 32, [64, 1, 70], 4, id="mqa-d128-bs32-split4"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "kvh", "d", "bs", "lens", "splits"), DECODE_CASES)
def test_decode(
    h: int, kvh: int, d: int, bs: int, lens: list[int], splits: int, dtype: torch.dtype
) -> None:
    cache = PagedCache(24, bs, kvh, d, dtype, seed=h + d + bs)
    tables = cache.tables(lens)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    scale = d**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, cache.k, cache.v, tables, seq_lens, scale, num_splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    for i, n in enumerate(lens):
        expected = attend(q[i], *cache.context(tables[i], n), scale)
        err = (out[i].double() - expected).abs().max().item()
        assert err <= TOL[dtype], f"sequence {i} (len {n}): max abs error {err:.2e}"


def test_more_splits_than_blocks_of_context() -> None:
    """Splits past the end of a short sequence count for nothing (lse = -inf)."""
    cache = PagedCache(8, 8, 2, 64, torch.float32, seed=3)
    lens = [1, 5]
    tables = cache.tables(lens)
    q = torch.randn(2, 4, 64).to(DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, cache.k, cache.v, tables, lens_t, 0.125, num_splits=5)
    for i, n in enumerate(lens):
        expected = attend(q[i], *cache.context(tables[i], n), 0.125)
        assert (out[i].double() - expected).abs().max().item() <= 1e-5


def test_split_count_heuristic() -> None:
    assert choose_num_splits(4, 8, 32_000, num_sms=0) == 1  # CPU: never split
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1  # short: one split of <= 256 tokens
    assert choose_num_splits(1, 8, 8192, num_sms=132) == 32  # long, small batch: by length
    assert choose_num_splits(1, 8, 32_000, num_sms=132) == 33  # 2 x 132 programs / 8 heads
    assert choose_num_splits(256, 8, 32_000, num_sms=132) == 1  # the batch fills the GPU


# (query heads, KV heads, head dim, block size, [(cached prefix, chunk length)]).
PREFILL_CASES = [
    pytest.param(4, 4, 64, 16, [(0, 7)], id="mha-no-prefix"),
    pytest.param(8, 2, 80, 8, [(0, 19), (16, 5)], id="gqa4-d80-bs8-prefix-at-boundary"),
    pytest.param(7, 1, 128, 32, [(13, 17), (0, 1), (40, 3)], id="gqa7-d128-bs32-mixed"),
    pytest.param(4, 1, 64, 16, [(5, 20)], id="mqa-partial-prefix"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "kvh", "d", "bs", "chunks"), PREFILL_CASES)
def test_prefill_chunks(
    h: int, kvh: int, d: int, bs: int, chunks: list[tuple[int, int]], dtype: torch.dtype
) -> None:
    lens = [p + c for p, c in chunks]
    cache = PagedCache(24, bs, kvh, d, dtype, seed=h * d + bs)
    tables = cache.tables(lens)
    total = sum(c for _, c in chunks)
    q = torch.randn(total, h, d, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    starts = [0]
    for _, c in chunks:
        starts.append(starts[-1] + c)
    scale = d**-0.5
    out = paged_prefill_attention(
        q,
        cache.k,
        cache.v,
        tables,
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        max(c for _, c in chunks),
        scale,
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i, (prefix, c) in enumerate(chunks):
        k, v = cache.context(tables[i], prefix + c)
        for j in range(c):  # query j sees keys 0 .. prefix + j
            row = starts[i] + j
            expected = attend(q[row], k[: prefix + j + 1], v[: prefix + j + 1], scale)
            err = (out[row].double() - expected).abs().max().item()
            assert err <= TOL[dtype], f"chunk {i} query {j}: max abs error {err:.2e}"
