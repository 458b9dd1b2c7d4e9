"""Fused RMSNorm (+ residual) and rotary kernels against float64 formulas and HF's rotary."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.reference import DEVICE, DTYPES, TOL

pytest.importorskip("triton")

from compute_plane.kernels.rms_norm import add_rms_norm, rms_norm
from compute_plane.kernels.rotary import apply_rotary
from compute_plane.rotary import RotaryEmbedding


def _rand(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 80, 576])
def test_rms_norm(n: int, dtype: torch.dtype) -> None:
    x = _rand(5, n, seed=n, dtype=dtype) * 3
    w = _rand(n, seed=n + 1, dtype=dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    err = (out.double() - _norm64(x, w, 1e-6)).abs().max().item()
    assert err <= TOL[dtype] * 4, f"max abs error {err:.2e}"  # |w·x̂| reaches ~4 here


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_head_views(dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k norm: a strided [T, H, D] view of the qkv output, not copied."""
    t, h, kvh, d = 3, 4, 2, 80
    qkv = _rand(t, (h + 2 * kvh) * d, seed=7, dtype=dtype)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    w = _rand(d, seed=8, dtype=dtype)
    out = rms_norm(k, w, 1e-6)
    err = (out.double() - _norm64(k, w, 1e-6)).abs().max().item()
    assert err <= TOL[dtype] * 4, f"max abs error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    x = _rand(6, 80, seed=1, dtype=dtype)
    res = _rand(6, 80, seed=2, dtype=dtype)
    w = _rand(80, seed=3, dtype=dtype)
    out, summed = add_rms_norm(x, res, w, 1e-5)
    exact_sum = x.double() + res.double()
    assert (summed.double() - exact_sum).abs().max().item() <= TOL[dtype]
    err = (out.double() - _norm64(summed, w, 1e-5)).abs().max().item()
    assert err <= TOL[dtype] * 4, f"max abs error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 2, 64), (7, 1, 80), (3, 3, 128)])
def test_rotary_matches_transformers(h: int, kvh: int, d: int, dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = RotaryEmbedding(d, 64, 10000.0, None, DEVICE, torch.float32)
    positions = torch.tensor([0, 5, 63, 17], device=DEVICE)
    q = _rand(4, h, d, seed=h, dtype=dtype)
    k = _rand(4, kvh, d, seed=kvh + 10, dtype=dtype)
    q_out, k_out = apply_rotary(q, k, positions, rope.cos.to(dtype), rope.sin.to(dtype))
    # transformers' reference takes [B, heads, T, D] and cos/sin [B, T, D].
    cos, sin = rope.cos[positions][None].double(), rope.sin[positions][None].double()
    q_ref, k_ref = apply_rotary_pos_emb(
        q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], cos, sin
    )
    for ours, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert ours.dtype == dtype
        err = (ours.double() - ref[0].transpose(0, 1)).abs().max().item()
        assert err <= TOL[dtype] * 4, f"max abs error {err:.2e}"
