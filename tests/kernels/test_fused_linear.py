"""The small-batch linears with their input's op folded in (kernels/fused_linear.py):
against the separate kernels' rounded input (rms_norm / add_rms_norm, silu_and_mul) times
the weight in float64, and the new residual bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.reference import DEVICE, DTYPES, ON_GPU

pytest.importorskip("triton")

from compute_plane.kernels.activation import silu_and_mul
from compute_plane.kernels.fused_linear import (
    GEMV_ROWS,
    LayerLinears,
    norm_linear,
    rows_linear,
    silu_mul_linear,
)
from compute_plane.kernels.rms_norm import add_rms_norm, rms_norm

# a dot of K terms in fp32 (or 16-bit products summed in fp32), rounded once to the dtype
REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rand(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _check(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """out ≈ a @ w.T + b in float64, to the dtype's rounding of each output's magnitude."""
    exact = a.double() @ w.double().T + (b.double() if b is not None else 0.0)
    scale = a.double().abs() @ w.double().abs().T + 1e-30
    assert out.shape == exact.shape and out.dtype == a.dtype
    rel = ((out.double() - exact).abs() / scale).max().item()
    assert rel <= REL[a.dtype], f"error {rel:.2e} of the terms' magnitude"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "k", "n", "residual", "bias"),  # K, N not multiples of the blocks; each variant
    [
        (1, 80, 100, False, False),
        (3, 256, 320, True, False),
        (16, 80, 100, True, True),
        (1, 256, 320, True, True),
        (16, 256, 320, False, True),
    ],
)
def test_norm_linear(
    rows: int, k: int, n: int, residual: bool, bias: bool, dtype: torch.dtype
) -> None:
    x = _rand(rows, k, seed=rows + k, dtype=dtype) * 3
    r = _rand(rows, k, seed=7, dtype=dtype) if residual else None
    g = _rand(k, seed=8, dtype=dtype)
    w = _rand(n, k, seed=9, dtype=dtype) / k**0.5
    b = _rand(n, seed=10, dtype=dtype) if bias else None
    out, h = norm_linear(x, r, g, 1e-6, w, b)
    if r is None:
        normed, summed = rms_norm(x, g, 1e-6), x
        assert h is x
    else:
        normed, summed = add_rms_norm(x, r, g, 1e-6)
        assert torch.equal(h, summed), "the new residual stream, as add_rms_norm's"
    _check(out, normed, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter", "n"), [(1, 96, 64), (5, 300, 130), (16, 300, 130)])
def test_silu_mul_linear(rows: int, inter: int, n: int, dtype: torch.dtype) -> None:
    gate_up = _rand(rows, 2 * inter, seed=inter + rows, dtype=dtype) * 3
    w = _rand(n, inter, seed=11, dtype=dtype) / inter**0.5
    _check(silu_mul_linear(gate_up, w), silu_and_mul(gate_up), w, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "k", "n", "bias"), [(1, 200, 72, False), (2, 64, 40, True),
                                                      (4, 130, 33, False), (7, 200, 72, True)])  # fmt: skip
def test_rows_linear(rows: int, k: int, n: int, bias: bool, dtype: torch.dtype) -> None:
    x = _rand(rows, k, seed=rows + k, dtype=dtype)
    w = _rand(n, k, seed=12, dtype=dtype) / k**0.5
    b = _rand(n, seed=13, dtype=dtype) if bias else None
    _check(rows_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("gemv", [True, False], ids=["matrix-vector", "tensor-core"])
def test_every_config_the_autotuner_may_pick(gemv: bool) -> None:
    """Each config of each form, not only the one the autotuner picks here (the interpreter
    runs one config, the GPU the fastest): every op folded in by turns, a K shorter than
    the K tile (the preloaded first tile is the whole row) and one of several tiles, and
    row counts on the form's side of GEMV_ROWS."""
    from compute_plane.kernels.fused_linear import NORM, PLAIN, SILU, _configs, _launch

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    rows = (1, 3) if gemv else (GEMV_ROWS + 3,)
    assert all(r <= GEMV_ROWS for r in rows) == gemv
    for i, config in enumerate(_configs(gemv)):
        mode, k, n = (NORM, SILU, PLAIN)[i % 3], (40, 200)[i % 2], 36
        for m in rows:
            w = _rand(n, k, seed=i, dtype=dtype) / k**0.5
            b = _rand(n, seed=i + 1, dtype=dtype) if mode == PLAIN else None
            if mode == SILU:
                x = _rand(m, 2 * k, seed=m, dtype=dtype)
                out = _launch(SILU, x, None, None, None, 0.0, w, None, k, config)
                _check(out, silu_and_mul(x), w, None)
                continue
            x = _rand(m, k, seed=m, dtype=dtype)
            if mode == PLAIN:
                _check(_launch(PLAIN, x, None, None, None, 0.0, w, b, k, config), x, w, b)
                continue
            r, g = _rand(m, k, seed=m + 5, dtype=dtype), _rand(k, seed=3, dtype=dtype)
            h = torch.empty_like(x)
            out = _launch(NORM, x, r, h, g, 1e-6, w, None, k, config)
            normed, summed = add_rms_norm(x, r, g, 1e-6)
            assert torch.equal(h, summed), config
            _check(out, normed, w, None)


def test_more_rows_than_the_kernel_takes_is_refused() -> None:
    x = torch.zeros(17, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="at most 16"):
        norm_linear(x, None, torch.ones(8, device=DEVICE), 1e-6, torch.zeros(4, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_start_up_check_of_agreement(dtype: torch.dtype) -> None:
    """What the start-up choice checks before it times (a kernel miscompiled for the GPU
    must not be chosen): one layer's fused and separate outputs agree here, and a product
    off by one part in ten, or a new residual off by one value, does not."""
    from compute_plane.kernels.fused_linear import _layer_ops, agree

    hidden, inter, q = 96, 160, 64
    layers = [
        LayerLinears(
            _rand(hidden, seed=1 + 10 * i, dtype=dtype),
            _rand(144, hidden, seed=2 + 10 * i, dtype=dtype) / hidden**0.5,
            _rand(hidden, q, seed=3 + 10 * i, dtype=dtype) / q**0.5,
            _rand(hidden, seed=4 + 10 * i, dtype=dtype),
            _rand(2 * inter, hidden, seed=5 + 10 * i, dtype=dtype) / hidden**0.5,
            _rand(hidden, inter, seed=6 + 10 * i, dtype=dtype) / inter**0.5,
            _rand(144, seed=7 + 10 * i, dtype=dtype),  # a qkv bias
        )
        for i in range(2)
    ]
    for rows in (GEMV_ROWS, GEMV_ROWS + 1):  # each form
        fused, separate = _layer_ops(rows, layers, 1e-6)
        ours, theirs = fused(), separate()
        assert len(ours) == 12 and agree(ours, theirs)
        assert not agree([*ours[:5], ours[5] * 1.1, *ours[6:]], theirs)  # a down product
        bent = ours[4].clone()
        bent[2, 7] += 1.0  # the new residual stream
        assert not agree([*ours[:4], bent, *ours[5:]], theirs)
        assert not agree([ours[0] - layers[0].qkv_bias, *ours[1:]], theirs)  # the bias
        assert not agree([*ours[:2], ours[2] * 0.9, *ours[3:]], theirs)  # the o product


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_GPU, id="cuda")])
def test_fused_rows_faster_times_both_ways_on_a_gpu(_: None) -> None:
    """The start-up choice (kernels captured in CUDA graphs): a row count it timed, with
    the fused form clearly faster at every count up to it, and not at the next."""
    from compute_plane.kernels.fused_linear import WIN, fused_rows_faster

    dtype, hidden, inter = torch.bfloat16, 256, 512
    layers = [
        LayerLinears(
            _rand(hidden, seed=1, dtype=dtype),
            _rand(384, hidden, seed=2 + i, dtype=dtype),
            _rand(hidden, 256, seed=3 + i, dtype=dtype),
            _rand(hidden, seed=4, dtype=dtype),
            _rand(2 * inter, hidden, seed=5 + i, dtype=dtype),
            _rand(hidden, inter, seed=6 + i, dtype=dtype),
        )
        for i in range(4)
    ]
    rows, timings = fused_rows_faster(layers, 1e-6)
    sizes = [1, 2, 4, 8, 16]
    assert [t["rows"] for t in timings] == sizes[: len(timings)]
    assert all(t["fused_us"] > 0 and t["separate_us"] > 0 for t in timings)
    won = [t["fused_us"] <= WIN * t["separate_us"] for t in timings]
    assert all(won[:-1]), "it stops at the first count where the fused form does not win"
    if won[-1]:
        assert len(timings) == len(sizes) and rows == sizes[-1]
    else:
        assert rows == (timings[-2]["rows"] if len(timings) > 1 else 0)


def test_tiles_longer_than_1024_are_timed_only_where_the_row_fills_half() -> None:
    """The autotuner times the 2048 and 4096 K tiles (a whole row of W read before the
    wait) only where at least half of the tile is inside the row; the others at any K."""
    from compute_plane.kernels.fused_linear import _configs, _long_tiles

    configs = _configs(True)
    tiles = {k: sorted({c.kwargs["BLOCK_K"] for c in _long_tiles(configs, {"K": k})}) for k in
             (40, 1024, 1025, 2048, 3072)}  # fmt: skip
    assert tiles == {
        40: [256, 512, 1024],
        1024: [256, 512, 1024],
        1025: [256, 512, 1024, 2048],
        2048: [256, 512, 1024, 2048],
        3072: [256, 512, 1024, 2048, 4096],
    }
    short = [c for c in configs if c.kwargs["BLOCK_K"] <= 1024]
    assert _long_tiles(configs, {"K": 40}) == short
