"""The CPU backend's C decode kernel (compute_plane/csrc/paged_attention_cpu.c).

Checked against the float64 textbook reference of the kernel tests (tests/kernels/
reference.py) over caches whose blocks are shuffled, for GQA groups, head dims that
are not a multiple of the kernel's 8 lanes, block sizes from 1 to 32, partial last
blocks, and both work splits (a KV head per item for small batches, a sequence per
item for large ones). Engine-level parity with transformers runs through this
backend too (tests/compute/test_parity.py asserts the backend is `cpu`).
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compute_plane import native
from compute_plane.attention import AttentionMetadata, TorchPagedAttention
from compute_plane.attention.cpu import CPUPagedAttention, KernelUnavailable, load_kernel
from compute_plane.attention.factory import resolve_attention_backend
from tests.kernels.reference import PagedCache, attend

CPU = torch.device("cpu")


def _decode(backend: TorchPagedAttention, q, cache: PagedCache, tables, lens, window=None):  # type: ignore[no-untyped-def]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_tables=tables,
        seq_lens=lens,
        query_lens=[1] * len(lens),
        num_decodes=len(lens),
        block_size=cache.block_size,
    )
    backend.prepare(meta)
    return backend.decode(q, cache.k, cache.v, meta, window)


@settings(max_examples=25, deadline=None)
@given(
    kvh=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([8, 36, 64]),
    block_size=st.sampled_from([1, 4, 16, 32]),
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_float64_reference(kvh, group, head_dim, block_size, lens, seed) -> None:  # type: ignore[no-untyped-def]
    heads = kvh * group
    need = sum(-(-n // block_size) for n in lens)
    cache = PagedCache(need + 1, block_size, kvh, head_dim, torch.float32, seed)
    tables = cache.tables(lens).to(CPU)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(seed))
    scale = head_dim**-0.5
    out = _decode(CPUPagedAttention(scale), q, cache, tables, lens)
    for i, n in enumerate(lens):
        k, v = cache.context(tables[i], n)
        expected = attend(q[i], k, v, scale)
        err = (out[i].double() - expected).abs().max().item()
        assert err <= 1e-4, f"sequence {i} (len {n}): max abs error {err:.2e}"


def test_kernel_equals_the_torch_backend_on_a_large_batch() -> None:
    """64 sequences (one item per sequence) at SmolLM2's shape, lengths 1..600."""
    rng = random.Random(0)
    lens = [rng.randint(1, 600) for _ in range(64)]
    cache = PagedCache(sum(-(-n // 16) for n in lens) + 1, 16, 3, 64, torch.float32, 0)
    tables = cache.tables(lens).to(CPU)
    q = torch.randn(64, 9, 64, generator=torch.Generator().manual_seed(1))
    ours = _decode(CPUPagedAttention(0.125), q, cache, tables, lens)
    theirs = _decode(TorchPagedAttention(0.125), q, cache, tables, lens)
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5, f"max abs difference {err:.2e}"


def test_loading_the_kernel_keeps_subnormals() -> None:
    """The library is built without crtfastmath: loading it must not turn on flush-to-zero
    for the process (torch's arithmetic included)."""
    load_kernel()
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1.0).item() > 0
    assert np.float32(1e-39) * np.float32(1.0) > 0


def test_backend_choice() -> None:
    assert resolve_attention_backend("auto", CPU, torch.float32) == "cpu"
    assert resolve_attention_backend("auto", CPU, torch.bfloat16) == "torch"
    assert resolve_attention_backend("torch", CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="float32"):
        resolve_attention_backend("cpu", CPU, torch.float16)


def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """auto warns and takes the torch backend; asking for `cpu` is a clear error."""
    monkeypatch.setenv("HETERO_INFER_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    _clear()
    try:
        with pytest.raises(KernelUnavailable, match="no-such-cc"):
            load_kernel()
        with caplog.at_level(logging.WARNING):
            assert resolve_attention_backend("auto", CPU, torch.float32) == "torch"
        assert "CPU attention kernel unavailable" in caplog.text
        with pytest.raises(ValueError, match=r"attention backend .cpu.*no-such-cc"):
            resolve_attention_backend("cpu", CPU, torch.float32)
    finally:
        _clear()


def test_an_unusable_cache_dir_falls_back_as_no_compiler_does(
    monkeypatch, tmp_path, caplog
) -> None:  # type: ignore[no-untyped-def]
    """A HETERO_INFER_CACHE_DIR that cannot be made (under a file) was a NotADirectoryError
    traceback at compute plane start-up; now auto warns and takes torch, `cpu` names it."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HETERO_INFER_CACHE_DIR", str(tmp_path / "file" / "cache"))
    _clear()
    try:
        with pytest.raises(KernelUnavailable, match=r"HETERO_INFER_CACHE_DIR.*Not a directory"):
            load_kernel()
        with caplog.at_level(logging.WARNING):
            assert resolve_attention_backend("auto", CPU, torch.float32) == "torch"
        with pytest.raises(ValueError, match=r"attention backend .cpu.*HETERO_INFER_CACHE_DIR"):
            resolve_attention_backend("cpu", CPU, torch.float32)
    finally:
        _clear()


def _clear() -> None:
    load_kernel.cache_clear()
    native.load_library.cache_clear()


def test_compiler_errors_are_reported(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A source that does not compile names the command and the compiler's message."""
    bad = tmp_path / "csrc" / "paged_attention_cpu.c"
    bad.parent.mkdir()
    bad.write_text("int paged_decode_attention_f32( {\n")
    monkeypatch.setenv("HETERO_INFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "CSRC", bad.parent)
    _clear()
    try:
        with pytest.raises(KernelUnavailable, match=r"csrc/paged_attention_cpu\.c.*failed"):
            load_kernel()
        assert not list((tmp_path / "cache").glob("*.so")), "no half-built library is kept"
    finally:
        _clear()


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_reads_only_the_window(window: int) -> None:
    """Each query sees its last `window` tokens; blocks wholly before them point at a NaN
    block and are never read (the control plane may have reused them)."""
    lens = [1, 9, 23, 64]
    cache = PagedCache(40, 4, 2, 36, torch.float32, window)
    tables = cache.tables(lens).to(CPU)
    q = torch.randn(len(lens), 6, 36, generator=torch.Generator().manual_seed(window))
    expected = []
    for i, n in enumerate(lens):
        k, v = cache.context(tables[i], n)
        expected.append(attend(q[i], k[max(0, n - window) :], v[max(0, n - window) :], 1 / 6))
    cache.k[0], cache.v[0] = float("nan"), float("nan")
    for i, n in enumerate(lens):
        tables[i, : max(0, n - window) // 4] = 0
    out = _decode(CPUPagedAttention(1 / 6), q, cache, tables, lens, window)
    for i, n in enumerate(lens):
        err = (out[i].double() - expected[i]).abs().max().item()
        assert err <= 1e-4, f"sequence {i} (len {n}): max abs error {err:.2e}"
