"""Fused RMSNorm (+ residual), rotary (+ per-head norm) and SiLU-and-multiply kernels
against float64 formulas and HF's rotary."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.reference import DEVICE, DTYPES, TOL

pytest.importorskip("triton")

from compute_plane.kernels.activation import silu_and_mul
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


ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, H, D] rotated by per-token cos/sin [T, D] (rotate_half layout), in float64."""
    half = x.shape[-1] // 2
    x = x.double()
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None].double() + rotated * sin[:, None].double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 2, 64), (7, 1, 80), (16, 8, 128)])
def test_norm_and_rotary_in_one_launch(h: int, kvh: int, d: int, dtype: torch.dtype) -> None:
    """Qwen3's q/k norm then the rotation, on strided head views of one qkv output: the
    float64 formula, and the separate kernels (rms_norm, then apply_rotary) to rounding."""
    t = 5
    rope = RotaryEmbedding(d, 64, 1e6, None, DEVICE, torch.float32)
    positions = torch.tensor([0, 1, 63, 17, 30], device=DEVICE)
    qkv = _rand(t, (h + 2 * kvh) * d, seed=d + h, dtype=dtype) * 2
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    qw, kw = _rand(d, seed=1, dtype=dtype), _rand(d, seed=2, dtype=dtype)
    cos, sin = rope.cos.to(dtype), rope.sin.to(dtype)
    q_out, k_out = apply_rotary(q, k, positions, cos, sin, qw, kw, 1e-6)
    sep_q, sep_k = apply_rotary(rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), positions, cos, sin)
    c, s_ = cos[positions], sin[positions]
    for ours, x, w, sep in ((q_out, q, qw, sep_q), (k_out, k, kw, sep_k)):
        assert ours.dtype == dtype and ours.is_contiguous()
        ref = _rotate64(_norm64(x, w, 1e-6), c, s_)
        err = (ours.double() - ref).abs().max().item()
        assert err <= TOL[dtype] * 8, f"max abs error {err:.2e}"
        # The same roundings as the two kernels: equal but for the sum's order (an ulp).
        diff = (ours.double() - sep.double()).abs().max().item()
        assert diff <= 2 * ULP[dtype] * sep.double().abs().max().item(), f"vs separate: {diff:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1000, 3072])
def test_silu_and_mul(inter: int, dtype: torch.dtype) -> None:
    """silu(gate) * up over a [T, 2I] gate|up output (I not a multiple of the block too)."""
    gate_up = _rand(3, 2 * inter, seed=inter, dtype=dtype) * 4
    out = silu_and_mul(gate_up)
    assert out.shape == (3, inter) and out.dtype == dtype
    g, u = gate_up.double().chunk(2, dim=-1)
    exact = g / (1 + torch.exp(-g)) * u
    err = (out.double() - exact).abs().max().item()
    assert err <= TOL[dtype] * 16, f"max abs error {err:.2e}"  # |silu(g)·u| reaches ~16
    gate, up = gate_up.chunk(2, dim=-1)
    torch_ops = (torch.nn.functional.silu(gate) * up).double()  # what the torch path computes
    rel = ((out.double() - torch_ops).abs() / torch_ops.abs().clamp_min(1e-3)).max().item()
    # On a GPU tl.exp is ex2.approx of g·log2(e): that product's rounding alone is ~1e-6 of
    # the exponent at |g| ~ 16, ~5.5 ulp of exp(-g) in fp32, which torch's expf does not
    # have (4.7-4.8 ulp seen on an H200, 2026-11-27); in fp16/bf16 the rounding to the
    # dtype dominates.
    assert rel <= 8 * ULP[dtype], f"vs F.silu(gate) * up: relative {rel:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True], ids=["rotary", "norm+rotary"])
@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 2, 64), (7, 1, 80)])
def test_rotate_into_cache(h: int, kvh: int, d: int, norm: bool, dtype: torch.dtype) -> None:
    """The rotation storing k and v at their cache slots: the same values as the rotation
    then the scatter (apply_rotary + write_kv, bit for bit), against the float64 formula
    and a plain loop of slot writes; no other slot of either cache changes."""
    from compute_plane.kernels.cache_ops import write_kv
    from compute_plane.kernels.rotary import rotate_into_cache

    t, bs, blocks = 5, 4, 6
    rope = RotaryEmbedding(d, 64, 1e4, None, DEVICE, torch.float32)
    cos, sin = rope.cos.to(dtype), rope.sin.to(dtype)
    positions = torch.tensor([3, 0, 63, 17, 30], device=DEVICE)
    qkv = _rand(t, (h + 2 * kvh) * d, seed=d + h + norm, dtype=dtype) * 2
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    qw, kw = (
        (_rand(d, seed=1, dtype=dtype), _rand(d, seed=2, dtype=dtype)) if norm else (None, None)
    )
    slots = torch.tensor([2 * bs + 3, 5 * bs, bs + 1, 0, 4 * bs + 2], device=DEVICE)
    k_cache = _rand(blocks, bs, kvh, d, seed=5, dtype=dtype)
    v_cache = _rand(blocks, bs, kvh, d, seed=6, dtype=dtype)
    sep_kc, sep_vc = k_cache.clone(), v_cache.clone()
    loop_kc, loop_vc = k_cache.clone(), v_cache.clone()

    q_out = rotate_into_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slots, qw, kw, 1e-6)
    sep_q, sep_k = apply_rotary(q, k, positions, cos, sin, qw, kw, 1e-6)
    write_kv(sep_k, v, sep_kc, sep_vc, slots)
    assert torch.equal(q_out, sep_q)
    assert torch.equal(k_cache, sep_kc) and torch.equal(v_cache, sep_vc)

    c, s_ = cos[positions], sin[positions]
    k_ref = _rotate64(_norm64(k, kw, 1e-6) if kw is not None else k, c, s_)
    for i, slot in enumerate(slots.tolist()):
        loop_kc[slot // bs, slot % bs] = k_ref[i].to(dtype)
        loop_vc[slot // bs, slot % bs] = v[i]
    assert torch.equal(v_cache, loop_vc)
    written = torch.zeros(blocks * bs, dtype=torch.bool)
    written[slots.cpu()] = True
    flat_k, flat_loop = k_cache.view(-1, kvh, d), loop_kc.view(-1, kvh, d)
    assert torch.equal(flat_k[~written.to(DEVICE)], flat_loop[~written.to(DEVICE)])
    err = (flat_k[slots].double() - k_ref).abs().max().item()
    assert err <= TOL[dtype] * 8, f"max abs error {err:.2e}"

    # the torch path's RotaryEmbedding.rotate_into_cache (the rotation, then index_copy_)
    torch_rope = RotaryEmbedding(d, 64, 1e4, None, DEVICE, dtype)
    tq = torch_rope.rotate_into_cache(
        q, k, v, positions, loop_kc, loop_vc, slots, qw, kw, 1e-6, rms_norm
    )
    assert torch.equal(loop_vc, v_cache)
    for ours, ref in ((q_out, tq), (k_cache, loop_kc)):
        err = (ours.double() - ref.double()).abs().max().item()
        assert err <= TOL[dtype] * 8, f"vs the torch path: {err:.2e}"
