"""Linear layers of a few rows with the op before them folded in, one launch each.

    norm_linear       rms_norm(x + residual) @ W.T (+ bias), and x + residual
                      (a layer's input norm before q|k|v, its MLP norm before gate|up)
    silu_mul_linear   (silu(gate) * up) @ W.T (the down projection)

A decode step of one or a few sequences is bound by its launches more than by its
reads: the norm and the SiLU are kernels of a few microseconds each, between matrix
products that stream the weights. Here each program computes BLOCK_N outputs for all
rows: it streams its [BLOCK_N, K] slice of W once and recomputes the input's op over
the whole row (K values per row, cheap beside the slice), so nothing is written
between the two. The rows are padded to 16 (`tl.dot`'s least M); `MAX_ROWS` rows at
most. The input's roundings are the separate ops': the sum is rounded to the dtype (it
is the new residual), normalised in fp32, rounded, scaled by the weight; silu(gate) is
rounded before the product. The orders of summation differ (the mean square in
blocks of the row, the dot's from cuBLAS's), so results agree to rounding, not bit for
bit: steps of at most `Model.fused_rows` tokens round differently from larger ones.

Whether the fused form is faster than the norm kernel + cuBLAS depends on the GPU and
the shapes: `fused_rows_faster` times both, captured in CUDA graphs, on the model's
own shapes at start-up, and the model uses the fused form only up to the row count
where it wins by a clear margin (`Model.fused_rows`; a near tie goes to the separate
kernels, so that restarts on one GPU choose alike). The autotuner picks a config per
(N, K) at the first call (one row, at start-up) and keeps it for up to 16 rows: tuning
per row count would tune again in the middle of serving.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from compute_plane.kernels import interpreted

MAX_ROWS = 16
WIN = 0.9  # the fused form is used where it takes at most this share of the separate's time
AGREE = 0.02  # its outputs' largest difference from the separate's, of their largest value


@triton.jit
def _input_rows(x_ptr, r_ptr, rm, rk, mask, stride_x, stride_r, ty, HAS_RES: tl.constexpr):
    """x (+ residual, rounded to the dtype as the new residual stream) as fp32 rows."""
    h = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + rm[:, None] * stride_r + rk[None, :], mask=mask, other=0.0)
        h = (h + r.to(tl.float32)).to(ty).to(tl.float32)
    return h


def _configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in ((16, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 8, 3))
    ]  # fmt: skip


def _fused_linear(
    x_ptr,  # [M, K], or [M, 2K] gate | up (not NORM)
    r_ptr,  # residual [M, K] (HAS_RES)
    h_ptr,  # x + residual [M, K] contiguous, written by program 0 (HAS_RES)
    g_ptr,  # norm weight [K] (NORM)
    w_ptr,  # [N, K], rows contiguous
    b_ptr,  # bias [N] (HAS_BIAS)
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    eps,
    stride_x,
    stride_r,
    stride_w,
    NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products (no tf32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_w = rn.to(tl.int64)  # row offsets into W pass 2^31 elements on large models
    ty = out_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # the row's mean square first (and the new residual, once)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (rk < K)[None, :]
            h = _input_rows(x_ptr, r_ptr, rm, rk, mask, stride_x, stride_r, ty, HAS_RES)
            if HAS_RES:  # noqa: SIM102 (a constexpr branch, then a runtime one)
                if pid == 0:  # the new residual stream, from one program
                    tl.store(h_ptr + rm[:, None] * K + rk[None, :], h.to(ty), mask=mask)
            ss += tl.sum(h * h, 1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        mask = m_mask[:, None] & k_mask[None, :]
        if NORM:
            h = _input_rows(x_ptr, r_ptr, rm, rk, mask, stride_x, stride_r, ty, HAS_RES)
            g = tl.load(g_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
            a = (h * rstd[:, None]).to(ty).to(tl.float32) * g[None, :]
        else:
            base = x_ptr + rm[:, None] * stride_x + rk[None, :]
            gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(base + K, mask=mask, other=0.0).to(tl.float32)
            a = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32) * up
        w_ptrs = w_ptr + rn_w[:, None] * stride_w + rk[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a.to(ty), tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(ty), mask=m_mask[:, None] & n_mask[None, :])


# On a GPU each (N, K) is tuned at its first call (the start-up choice, before any CUDA
# graph is captured); the interpreter runs one config.
_kernel = (
    triton.jit(_fused_linear)
    if interpreted()
    else triton.autotune(configs=_configs(), key=["N", "K", "NORM"])(triton.jit(_fused_linear))
)
_INTERPRETED = {"BLOCK_N": 32, "BLOCK_K": 64}


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    h: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    m = x.shape[0]
    n = weight.shape[0]
    assert m <= MAX_ROWS, f"{m} rows: the fused linear takes at most {MAX_ROWS}"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert weight.dtype == x.dtype, "dense weights in the activations' dtype"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return out

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    extra = _INTERPRETED if interpreted() else {}
    _kernel[grid](
        x, residual if residual is not None else x, h if h is not None else x,
        norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out, m, n, k, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        NORM=norm_weight is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, BLOCK_M=16, **extra,
    )  # fmt: skip
    return out


def norm_linear(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]: added to x first (None: x alone)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, norm_weight) @ weight.T + bias, x + residual) in one launch;
    with no residual the second is x itself."""
    k = x.shape[1]
    if residual is None:
        return _launch(x, None, None, norm_weight, eps, weight, bias, k), x
    assert residual.shape == x.shape and residual.stride(1) == 1
    h = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    return _launch(x, residual, h, norm_weight, eps, weight, bias, k), h


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, 2I] gate | up -> (silu(gate) * up) @ weight.T, [M, N], in one launch."""
    two = gate_up.shape[1]
    assert two % 2 == 0
    return _launch(gate_up, None, None, None, 0.0, weight, None, two // 2)


def _graph_us(fn: Callable[[], object], reps: int = 10, iters: int = 20) -> float:
    """Microseconds per call of `fn`, `reps` calls captured in a CUDA graph and replayed
    (the cost inside a decode graph, launches included)."""
    fn()
    fn()  # tunes the fused kernel's config, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


def _layer_ops(
    rows: int,
    norm_weight: torch.Tensor,
    after_norm: list[torch.Tensor],
    down: torch.Tensor | None,
    eps: float,
) -> tuple[Callable[[], list[torch.Tensor]], Callable[[], list[torch.Tensor]]]:
    """One layer's norms and projections on `rows` random rows, fused and separate: each
    gives its outputs (per projection after a norm, the product and the new residual; the
    down projection's product)."""
    from compute_plane.kernels.activation import silu_and_mul
    from compute_plane.kernels.rms_norm import add_rms_norm

    dev, dtype, hidden = norm_weight.device, norm_weight.dtype, norm_weight.shape[0]
    g = torch.Generator(device=dev).manual_seed(rows)
    x, r = (torch.randn(rows, hidden, device=dev, generator=g).to(dtype) for _ in range(2))
    gu = None if down is None else torch.randn(rows, 2 * down.shape[1], device=dev).to(dtype)

    def fused() -> list[torch.Tensor]:
        outs = [t for w in after_norm for t in norm_linear(x, r, norm_weight, eps, w)]
        if down is not None and gu is not None:
            outs.append(silu_mul_linear(gu, down))
        return outs

    def separate() -> list[torch.Tensor]:
        outs = []
        for w in after_norm:
            normed, summed = add_rms_norm(x, r, norm_weight, eps)
            outs += [torch.nn.functional.linear(normed, w), summed]
        if down is not None and gu is not None:
            outs.append(torch.nn.functional.linear(silu_and_mul(gu), down))
        return outs

    return fused, separate


def agree(fused: list[torch.Tensor], separate: list[torch.Tensor]) -> bool:
    """The fused outputs equal the separate ones to rounding: each within AGREE of the
    largest magnitude of its counterpart (sums in another order differ by a few ulp; a
    kernel miscompiled for this GPU differs by far more)."""
    return len(fused) == len(separate) and all(
        a.shape == b.shape
        and bool(((a.float() - b.float()).abs().max() <= AGREE * b.float().abs().max()).item())
        for a, b in zip(fused, separate, strict=True)
    )


def fused_rows_faster(
    norm_weight: torch.Tensor,  # [hidden]: a layer's input norm
    after_norm: list[torch.Tensor],  # the projections after a norm: q|k|v, gate|up [N, hidden]
    down: torch.Tensor | None,  # [hidden, I]: after silu(gate) * up (None: another activation)
    eps: float,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> tuple[int, list[dict[str, float]]]:
    """The most rows up to which one layer's fused linears take at most WIN of the time of
    its separate kernels (add_rms_norm / silu_and_mul, then torch's matmul), both timed
    inside CUDA graphs on these weights (median of 3) at each row count of `sizes` in
    turn; 0 where they do not at the first. With the timings (µs per layer, each way).
    Raises if the two disagree beyond rounding (`agree`) at a row count."""
    best, timings = 0, []
    for rows in sizes:
        fused, separate = _layer_ops(rows, norm_weight, after_norm, down, eps)
        if not agree(fused(), separate()):
            raise RuntimeError(
                f"the fused linears disagree with the separate kernels ({rows} rows)"
            )
        f = statistics.median(_graph_us(fused) for _ in range(3))
        s = statistics.median(_graph_us(separate) for _ in range(3))
        timings.append({"rows": rows, "fused_us": round(f, 2), "separate_us": round(s, 2)})
        if f > WIN * s:
            break
        best = rows
    return best, timings
