"""The linear layers' kernel: oneDNN's fp32 matmul on CPU float32, else F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from compute_plane.model import onednn_linear, pick_linear

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


@needs_onednn
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 70),
    k=st.integers(1, 300),
    n=st.integers(1, 300),
    bias=st.booleans(),
    transposed_input=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_onednn_linear_matches_float64(
    rows: int, k: int, n: int, bias: bool, transposed_input: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(k, rows, generator=g).t()
        if transposed_input
        else torch.randn(rows, k, generator=g)
    )
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    out = onednn_linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    # fp32 sums of k products: error grows with k and the terms' size.
    tol = 1e-5 * k**0.5 * (x.abs().max() * w.abs().max()).item() + 1e-5
    assert (out.double() - ref).abs().max().item() <= tol


@needs_onednn
def test_cpu_float32_uses_onednn() -> None:
    assert pick_linear(torch.device("cpu"), torch.float32) is onednn_linear


def test_other_devices_and_dtypes_use_f_linear() -> None:
    assert pick_linear(torch.device("cpu"), torch.bfloat16) is F.linear
    assert pick_linear(torch.device("cuda"), torch.float32) is F.linear


def test_no_onednn_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert pick_linear(torch.device("cpu"), torch.float32) is F.linear


def test_broken_onednn_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no oneDNN kernel for this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    assert pick_linear(torch.device("cpu"), torch.float32) is F.linear
