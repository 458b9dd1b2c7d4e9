"""Paged-attention kernels against a float64 reference over the same paged cache."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.reference import DEVICE, ON_GPU, TOL, PagedCache, attend

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


# The cache's dtype, and whether the dots take its values as they are (None: the default,
# native for fp16 and, on a GPU, bf16) or fp32 copies in tf32 dots.
NATIVE_CASES = [
    pytest.param(torch.float32, None, id="fp32"),
    pytest.param(torch.float16, None, id="fp16-native"),  # fp16 dots, fp32 softmax
    pytest.param(torch.float16, False, id="fp16-fp32-copies"),
    pytest.param(torch.bfloat16, None, id="bf16", marks=ON_GPU),
    pytest.param(torch.bfloat16, False, id="bf16-fp32-copies", marks=ON_GPU),
]


@pytest.mark.parametrize(("dtype", "native"), NATIVE_CASES)
@pytest.mark.parametrize(("h", "kvh", "d", "bs", "lens", "splits"), DECODE_CASES)
def test_decode(
    h: int,
    kvh: int,
    d: int,
    bs: int,
    lens: list[int],
    splits: int,
    dtype: torch.dtype,
    native: bool | None,
) -> None:
    cache = PagedCache(24, bs, kvh, d, dtype, seed=h + d + bs)
    tables = cache.tables(lens)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    scale = d**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        q, cache.k, cache.v, tables, seq_lens, scale, num_splits=splits, native=native
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i, n in enumerate(lens):
        expected = attend(q[i], *cache.context(tables[i], n), scale)
        err = (out[i].double() - expected).abs().max().item()
        assert err <= TOL[dtype], f"sequence {i} (len {n}): max abs error {err:.2e}"


@pytest.mark.parametrize("window", [None, 20], ids=["all", "window20"])
def test_more_splits_than_blocks_of_context(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """Splits that start past the end of a short sequence (as in a CUDA graph captured for
    the longest context) write nothing and the combine reads nothing of them: the partial
    outputs and log-sum-exps start as NaN here, and only the live splits' are read."""

    def poisoned(*shape: int, **kwargs: object) -> torch.Tensor:
        return torch.full(shape[0] if len(shape) == 1 else shape, float("nan"), **kwargs)

    cache = PagedCache(24, 8, 2, 64, torch.float32, seed=3)
    lens = [1, 5, 17, 40, 70]  # 1 to 5 of the 16-position tiles; 12 splits
    tables = cache.tables(lens)
    q = torch.randn(len(lens), 4, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(torch, "empty", poisoned)  # the kernel's partial buffers
    out = paged_decode_attention(
        q, cache.k, cache.v, tables, lens_t, 0.125, num_splits=12, window=window
    )
    monkeypatch.undo()
    for i, n in enumerate(lens):
        k, v = cache.context(tables[i], n)
        first = max(0, n - window) if window else 0
        expected = attend(q[i], k[first:], v[first:], 0.125)
        assert (out[i].double() - expected).abs().max().item() <= 1e-5, (i, n)


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


@pytest.mark.parametrize(("dtype", "native"), NATIVE_CASES[:4])
@pytest.mark.parametrize(("h", "kvh", "d", "bs", "chunks"), PREFILL_CASES)
def test_prefill_chunks(
    h: int,
    kvh: int,
    d: int,
    bs: int,
    chunks: list[tuple[int, int]],
    dtype: torch.dtype,
    native: bool | None,
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
        native=native,
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i, (prefix, c) in enumerate(chunks):
        k, v = cache.context(tables[i], prefix + c)
        for j in range(c):  # query j sees keys 0 .. prefix + j
            row = starts[i] + j
            expected = attend(q[row], k[: prefix + j + 1], v[: prefix + j + 1], scale)
            err = (out[row].double() - expected).abs().max().item()
            assert err <= TOL[dtype], f"chunk {i} query {j}: max abs error {err:.2e}"


def _forget_before(cache: PagedCache, tables: torch.Tensor, first: list[int]) -> torch.Tensor:
    """The tables with every block wholly before position first[i] pointing at block 0,
    filled with NaN: a kernel that reads outside a window returns NaN."""
    cache.k[0], cache.v[0] = float("nan"), float("nan")
    out = tables.clone()
    for i, f in enumerate(first):
        out[i, : f // cache.block_size] = 0
    return out


# (query heads, KV heads, head dim, block size, context lengths, splits, window).
WINDOW_DECODE_CASES = [
    pytest.param(4, 2, 64, 4, [1, 9, 23], 1, 6, id="w6-bs4"),
    pytest.param(8, 2, 80, 8, [40, 3, 17], 3, 10, id="w10-bs8-split3"),
    pytest.param(4, 1, 64, 16, [64, 5, 70], 4, 16, id="w16-bs16-split4"),
]


@pytest.mark.parametrize(("h", "kvh", "d", "bs", "lens", "splits", "window"), WINDOW_DECODE_CASES)
def test_decode_sliding_window(
    h: int, kvh: int, d: int, bs: int, lens: list[int], splits: int, window: int
) -> None:
    """Each query sees its last `window` tokens; blocks before them are never read."""
    cache = PagedCache(32, bs, kvh, d, torch.float32, seed=window)
    tables = cache.tables(lens)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    scale = d**-0.5
    expected = []
    for i, n in enumerate(lens):
        k, v = cache.context(tables[i], n)
        expected.append(attend(q[i], k[max(0, n - window) :], v[max(0, n - window) :], scale))
    poisoned = _forget_before(cache, tables, [max(0, n - window) for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        q, cache.k, cache.v, poisoned, seq_lens, scale, num_splits=splits, window=window
    )
    for i, n in enumerate(lens):
        err = (out[i].double() - expected[i]).abs().max().item()
        assert err <= TOL[torch.float32], f"sequence {i} (len {n}): max abs error {err:.2e}"


def test_prefill_sliding_window() -> None:
    """Query at position p sees keys p - window + 1 .. p: within a chunk longer than the
    window, across a cached prefix, and a chunk shorter than it."""
    h, kvh, d, bs, window = 4, 2, 64, 4, 6
    chunks = [(0, 21), (13, 5), (3, 2)]
    lens = [p + c for p, c in chunks]
    cache = PagedCache(32, bs, kvh, d, torch.float32, seed=9)
    tables = cache.tables(lens)
    total = sum(c for _, c in chunks)
    q = torch.randn(total, h, d, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    starts = [0]
    for _, c in chunks:
        starts.append(starts[-1] + c)
    scale = d**-0.5
    expected = {}
    for i, (prefix, c) in enumerate(chunks):
        k, v = cache.context(tables[i], prefix + c)
        for j in range(c):
            lo, hi = max(0, prefix + j + 1 - window), prefix + j + 1
            expected[starts[i] + j] = attend(q[starts[i] + j], k[lo:hi], v[lo:hi], scale)
    poisoned = _forget_before(cache, tables, [max(0, p + 1 - window) for p, _ in chunks])
    out = paged_prefill_attention(
        q, cache.k, cache.v, poisoned,
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        max(c for _, c in chunks), scale, window=window,
    )  # fmt: skip
    for row, exp in expected.items():
        err = (out[row].double() - exp).abs().max().item()
        assert err <= TOL[torch.float32], f"row {row}: max abs error {err:.2e}"
