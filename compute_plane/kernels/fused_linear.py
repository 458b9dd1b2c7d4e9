"""Linear layers of a few rows with the op before them folded in, one launch each.

    norm_linear       rms_norm(x + residual) @ W.T (+ bias), and x + residual
                      (a layer's input norm before q|k|v, its MLP norm before gate|up)
    silu_mul_linear   (silu(gate) * up) @ W.T (the down projection)
    rows_linear       x @ W.T (+ bias), nothing folded in (the attention's output
                      projection, beside the others in a small step)

A decode step of one or a few sequences is bound by its launches more than by its
reads: the norm and the SiLU are kernels of a few microseconds each, between matrix
products that stream the weights. Here each program computes BLOCK_N outputs for all
rows: it streams its [BLOCK_N, K] slice of W once and recomputes the input's op over
the whole row (K values per row, cheap beside the slice), so nothing is written
between the two. Up to `GEMV_ROWS` rows the products are a matrix-vector form (each
weight tile multiplied into each row and summed along K on the CUDA cores: a decode
step of one sequence reads each weight once, with many small programs to keep the
memory busy); above, the rows are padded to 16 (`tl.dot`'s least M) and the tile goes
through the tensor cores; `MAX_ROWS` rows at most. The input's roundings are the
separate ops': the sum is rounded to the dtype (it is the new residual), normalised in
fp32, rounded, scaled by the weight; silu(gate) is rounded before the product. The
orders of summation differ (the mean square in blocks of the row, the dot's from
cuBLAS's), so results agree to rounding, not bit for bit: steps of at most
`Model.fused_rows` tokens round differently from larger ones.

Whether the fused form is faster than the norm kernel + cuBLAS depends on the GPU and
the shapes: `fused_rows_faster` times both, captured in CUDA graphs, on the model's
own weights at start-up (every layer's in turn, as a step reads them: one layer's
weights would stay in the L2 cache and flatter whichever form reads them best), and
the model uses the fused form only up to the row count where it wins by a clear margin
(`Model.fused_rows`; a near tie goes to the separate kernels, so that restarts on one
GPU choose alike). The autotuner picks a config per (N, K, op, row block) of each form
at its first call; the start-up choice makes that call for each row count it times,
before any CUDA graph is captured, so serving the counts it chose tunes nothing.
(Triton's autotuner times with the L2 cache cleared, as the weights come in a step.)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.autotuner import Autotuner

from compute_plane.kernels import PDL_LAUNCH, dependent_launch, interpreted

MAX_ROWS = 16
GEMV_ROWS = 4  # steps of at most this many rows: the matrix-vector form
PLAIN, NORM, SILU = 0, 1, 2  # the op folded in before the product (the kernel's MODE)
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


@triton.jit
def _tile(
    acc, w, x_ptr, r_ptr, g_ptr, rm, rk, m_mask, K, stride_x, stride_r, rstd, ty,
    MODE: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """acc + the rows' operand (the op folded in, over columns rk) times the W tile w."""
    k_mask = rk < K
    mask = m_mask[:, None] & k_mask[None, :]
    if MODE == 1:
        h = _input_rows(x_ptr, r_ptr, rm, rk, mask, stride_x, stride_r, ty, HAS_RES)
        g = tl.load(g_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        a = (h * rstd[:, None]).to(ty).to(tl.float32) * g[None, :]
    elif MODE == 2:
        base = x_ptr + rm[:, None] * stride_x + rk[None, :]
        gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + K, mask=mask, other=0.0).to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32) * up
    else:
        a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0)
        a = a.to(tl.float32)
    if DOT:
        if IEEE:
            acc += tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a.to(ty), tl.trans(w))
    else:  # each row times the tile, summed along K (the operand rounded as a dot's)
        a = a.to(ty).to(tl.float32)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    return acc


def _configs(gemv: bool, preload_only: bool = False) -> list[triton.Config]:
    shapes = (
        # matrix-vector: few outputs per program (N / BLOCK_N programs: a 1024-row
        # projection is 256 of them at 4), long K tiles in flight, the first one read
        # before the norm's pass or not (on an H200 the 1024-long tiles won each shape)
        ((2, 1024, 4, 2, False), (4, 512, 4, 2, False), (4, 1024, 4, 2, False),
         (8, 256, 4, 3, False), (8, 512, 4, 2, False), (16, 256, 4, 3, False),
         (16, 512, 8, 2, False), (2, 1024, 4, 2, True), (4, 1024, 4, 2, True),
         (4, 512, 4, 2, True), (8, 512, 4, 2, True), (1, 1024, 4, 2, True),
         # a program's whole row of W read before the wait where K is 2048 or 3072 (the
         # attention's output projection, the down projection), as at 1024 above: under
         # PDL the read overlaps the kernel before (`_long_tiles` keeps them off short K)
         (1, 2048, 4, 1, True), (2, 2048, 4, 1, True), (1, 4096, 4, 1, True))
        if gemv
        else ((16, 256, 4, 4, False), (32, 128, 4, 4, False), (64, 128, 4, 3, False),
              (64, 256, 8, 3, False))
    )  # fmt: skip
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PRELOAD": p}, num_warps=w, num_stages=s)
        for n, k, w, s, p in shapes
        if p or not preload_only
    ]


def _fused_linear(
    x_ptr,  # [M, K], or [M, 2K] gate | up (SILU)
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
    MODE: tl.constexpr,  # PLAIN, NORM, SILU
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 products (no tf32)
    DOT: tl.constexpr,  # the tensor-core form (rows padded to 16); else matrix-vector
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD: tl.constexpr,  # the first W tile loaded first (a config's choice)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (sm_90+; see _launch)
):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn_w = rn.to(tl.int64)  # row offsets into W pass 2^31 elements on large models
    ty = out_ptr.dtype.element_ty
    if PRELOAD:  # the weights' first tile is read while the norm's pass runs (long K tiles)
        rk0 = tl.arange(0, BLOCK_K)
        w0_ptrs = w_ptr + rn_w[:, None] * stride_w + rk0[None, :]
        w0 = tl.load(w0_ptrs, mask=n_mask[:, None] & (rk0 < K)[None, :], other=0.0)
    if PDL:  # the weights are the layer's own; the rows, the kernel before's outputs
        gdc_wait()  # that kernel done and its writes seen (nothing is read or written above)
        gdc_launch_dependents()  # the next may start loading its weights meanwhile
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if MODE == 1:  # NORM: the row's mean square first (and the new residual, once)
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
    k_start = 0
    if PRELOAD:  # the first tile, its read under way since the start
        acc = _tile(acc, w0, x_ptr, r_ptr, g_ptr, rm, rk0, m_mask, K, stride_x, stride_r,
                    rstd, ty, MODE, HAS_RES, IEEE, DOT)  # fmt: skip
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn_w[:, None] * stride_w + rk[None, :]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
        acc = _tile(acc, w, x_ptr, r_ptr, g_ptr, rm, rk, m_mask, K, stride_x, stride_r,
                    rstd, ty, MODE, HAS_RES, IEEE, DOT)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(ty), mask=m_mask[:, None] & n_mask[None, :])


def _long_tiles(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """The configs worth timing at this K: a K tile longer than 1024 only where at least
    half of it is inside the row (2048 and 4096 tiles are for K of 2048 and 3072)."""
    k = named_args["K"]
    return [c for c in configs if c.kwargs["BLOCK_K"] <= max(1024, 2 * k - 1)]


# On a GPU each (N, K, op, row block) of each form is tuned at its first call (the
# start-up choice, before any CUDA graph is captured); the interpreter runs one config.
def _tuned(gemv: bool, preload_only: bool = False) -> Any:
    kernel = triton.jit(_fused_linear)
    if interpreted():
        return kernel
    # (BLOCK_M too: the matrix-vector form's [rows, N, K] product grows with the rows; each
    # row count a small step meets is tuned by the start-up choice, which runs them first)
    configs = _configs(gemv, preload_only)
    return triton.autotune(
        configs=configs,
        key=["N", "K", "MODE", "BLOCK_M"],
        prune_configs_by={"early_config_prune": _long_tiles},
    )(kernel)


_gemv_kernel, _dot_kernel = _tuned(True), _tuned(False)
# As programmatic dependent launches, the matrix-vector form tuned among the configs that
# load their first weight tile before they wait: that read then overlaps the kernel before
# (at K = 1024 a tile of 1024 is the program's whole slice of W). The autotuner times each
# launch alone, so it cannot see that overlap.
_gemv_preload_kernel = _tuned(True, preload_only=True)


class Preload:
    """Whether the matrix-vector form takes `_gemv_preload_kernel`; None: where it is
    launched as a programmatic dependent (`benchmarks.gpu` times each way)."""

    only: bool | None = None


_INTERPRETED = {  # (each way of the loop: the first tile first, or all in the loop)
    True: {"BLOCK_N": 8, "BLOCK_K": 64, "PRELOAD": True},
    False: {"BLOCK_N": 32, "BLOCK_K": 64, "PRELOAD": False},
}


def _launch(
    mode: int,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    h: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    config: triton.Config | None = None,  # this one, not the autotuner's (tests)
    pdl: bool | None = None,
) -> torch.Tensor:
    """One launch of the kernel (the autotuner's config unless `config`). `pdl`: as a
    programmatic dependent launch (Hopper and later): it may start while the kernel before
    it runs, loads its first weight tile (with PRELOAD), then waits for that kernel's
    writes. None: as the process launches its kernels (`kernels.set_dependent_launch`,
    the engine's `--pdl`); the interpreter has no grid dependencies, so it runs without."""
    m = x.shape[0]
    n = weight.shape[0]
    assert m <= MAX_ROWS, f"{m} rows: the fused linear takes at most {MAX_ROWS}"
    gemv = m <= GEMV_ROWS
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert weight.dtype == x.dtype, "dense weights in the activations' dtype"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return out

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    kernel = _gemv_kernel if gemv else _dot_kernel
    if pdl is None:  # as the process launches (and then the preloading configs with PDL)
        launch = dependent_launch()
        preload = bool(launch) if Preload.only is None else Preload.only
    else:
        launch = PDL_LAUNCH if pdl and not interpreted() else {}
        preload = bool(Preload.only)
    if gemv and config is None and preload:
        kernel = _gemv_preload_kernel
    extra: dict[str, Any] = dict(_INTERPRETED[gemv]) if interpreted() else {}
    if config is not None:
        if isinstance(kernel, Autotuner):
            kernel = kernel.fn  # the function under the autotuner
        extra = dict(config.kwargs)
        if not interpreted():
            extra |= {"num_warps": config.num_warps, "num_stages": config.num_stages}
    extra |= launch
    kernel[grid](
        x, residual if residual is not None else x, h if h is not None else x,
        norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out, m, n, k, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        MODE=mode, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, DOT=not gemv,
        BLOCK_M=triton.next_power_of_2(m) if gemv else 16, **extra,
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
        return _launch(NORM, x, None, None, norm_weight, eps, weight, bias, k), x
    assert residual.shape == x.shape and residual.stride(1) == 1
    h = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    return _launch(NORM, x, residual, h, norm_weight, eps, weight, bias, k), h


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, 2I] gate | up -> (silu(gate) * up) @ weight.T, [M, N], in one launch."""
    two = gate_up.shape[1]
    assert two % 2 == 0
    return _launch(SILU, gate_up, None, None, None, 0.0, weight, None, two // 2)


def rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[M, K] @ weight.T (+ bias) -> [M, N], the kernel above with nothing folded in."""
    return _launch(PLAIN, x, None, None, None, 0.0, weight, bias, x.shape[1])


def _graph_us(fn: Callable[[], object], reps: int = 2, iters: int = 10) -> float:
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


@dataclass(frozen=True)
class LayerLinears:
    """One decoder layer's dense weights around its small-step products."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q + 2 kv, hidden]
    o: torch.Tensor | None  # [hidden, q] (None: not through rows_linear)
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor | None  # [hidden, I] after silu(gate) * up (None: another activation)
    qkv_bias: torch.Tensor | None = None  # [q + 2 kv] (Qwen2)


def _layer_ops(
    rows: int, layers: Sequence[LayerLinears], eps: float
) -> tuple[Callable[[], list[torch.Tensor]], Callable[[], list[torch.Tensor]]]:
    """The layers' norms and projections on `rows` random rows, one layer after another
    as a step runs them, fused and separate: each gives its outputs (per projection after
    a norm, the product and the new residual; the o and down projections' products). The
    first layer's input norm has no residual to add, as in a step: each variant of the
    kernel a step runs is built and checked here."""
    from compute_plane.kernels.activation import silu_and_mul
    from compute_plane.kernels.rms_norm import add_rms_norm, rms_norm

    first = layers[0]
    dev, dtype, hidden = first.input_norm.device, first.input_norm.dtype, first.qkv.shape[1]
    g = torch.Generator(device=dev).manual_seed(rows)

    def rand(width: int) -> torch.Tensor:
        return torch.randn(rows, width, device=dev, generator=g).to(dtype)

    x, r = rand(hidden), rand(hidden)
    o_in = rand(first.o.shape[1]) if first.o is not None else None
    gu = rand(2 * first.down.shape[1]) if first.down is not None else None
    linear = torch.nn.functional.linear

    def fused() -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for i, la in enumerate(layers):
            outs += norm_linear(x, r if i else None, la.input_norm, eps, la.qkv, la.qkv_bias)
            if la.o is not None and o_in is not None:
                outs.append(rows_linear(o_in, la.o))
            outs += norm_linear(x, r, la.mlp_norm, eps, la.gate_up)
            if la.down is not None and gu is not None:
                outs.append(silu_mul_linear(gu, la.down))
        return outs

    def separate() -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for i, la in enumerate(layers):
            if i:
                normed, summed = add_rms_norm(x, r, la.input_norm, eps)
            else:
                normed, summed = rms_norm(x, la.input_norm, eps), x
            outs += [linear(normed, la.qkv, la.qkv_bias), summed]
            if la.o is not None and o_in is not None:
                outs.append(linear(o_in, la.o))
            normed, summed = add_rms_norm(x, r, la.mlp_norm, eps)
            outs += [linear(normed, la.gate_up), summed]
            if la.down is not None and gu is not None:
                outs.append(linear(silu_and_mul(gu), la.down))
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
    layers: Sequence[LayerLinears],
    eps: float,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> tuple[int, list[dict[str, float]]]:
    """The most rows up to which the layers' fused linears take at most WIN of the time of
    their separate kernels (add_rms_norm / silu_and_mul, then torch's matmul), both timed
    inside CUDA graphs over these layers in turn (median of 3) at each row count of
    `sizes` in turn; 0 where they do not at the first. With the timings (µs per layer,
    each way). Raises if the two disagree beyond rounding (`agree`) at a row count."""
    best, timings = 0, []
    for rows in sizes:
        fused, separate = _layer_ops(rows, layers, eps)
        if not agree(fused(), separate()):
            raise RuntimeError(
                f"the fused linears disagree with the separate kernels ({rows} rows)"
            )
        f = statistics.median(_graph_us(fused) for _ in range(3)) / len(layers)
        s = statistics.median(_graph_us(separate) for _ in range(3)) / len(layers)
        timings.append({"rows": rows, "fused_us": round(f, 2), "separate_us": round(s, 2)})
        if f > WIN * s:
            break
        best = rows
    return best, timings
