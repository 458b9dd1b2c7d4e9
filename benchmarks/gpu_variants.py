"""Kernel variants of a decode step of one sequence, side by side ([M]: batch 1 <= 0.8 ms).

    python -m benchmarks.gpu_variants                # on a GPU: docs/perf/gpu_variants.json

The batch-1 decode step of the GPU benchmark's model (Qwen3-0.6B's shape, bf16, 28
layers) spends ~21 of its ~31 µs a layer in the four small-step linears (qkv, o,
gate|up, down; compute_plane/kernels/fused_linear.py) and ~8 in decode attention's
split and combine kernels. This measures the choices behind those figures, each timed
inside a CUDA graph over 28 copies of its operands in turn (as a step meets them: none
left in the L2 cache by the one before), in µs per launch and GB/s of what it must read:

1. `linears`: each projection at 1 row through every config of the matrix-vector form
   (the autotuner's `_configs(True)` and the `CANDIDATES` below), each checked against
   torch's result, with the separate kernels beside (the norm or SiLU kernel, then
   cuBLAS), and the config the autotuner picks: which configs it should have, and how
   far the best is from the copy bandwidth. `pdl`: the best config (and the best that
   loads its first weight tile before it waits) as programmatic dependent launches
   (sm_90+: each launch may start while the one before runs): what the gaps between
   the step's launches cost.
2. `attention`: decode attention of 1 sequence (Qwen3-0.6B's heads) at a context of
   512 and 4096 by split count, from 1 to the count the CUDA graphs use (sized for
   max_model_len, most splits then empty at a short context), whole (split + combine,
   with bf16 dots and with the dots on fp32 copies as before) and the combine alone.

Run it alone on the machine. `--layers` and `--shapes tiny` make it small enough for
the Triton interpreter (a test runs it so, timing by the clock).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import machine

# (name, op, N, K) at Qwen3-0.6B's shape: the projection's outputs and inputs.
SHAPES = {
    "qwen3-0.6b": [
        ("qkv", "norm", 4096, 1024),
        ("o", "plain", 1024, 2048),
        ("gate_up", "norm", 6144, 1024),
        ("down", "silu", 1024, 3072),
    ],
    "tiny": [("qkv", "norm", 48, 32), ("o", "plain", 32, 32), ("down", "silu", 32, 64)],
}
# Matrix-vector configs beside the autotuner's: (BLOCK_N, BLOCK_K, warps, stages, PRELOAD).
# More warps on long tiles (more loads in flight a program), single rows of W with the
# whole K in one tile, and short tiles in deeper pipelines.
CANDIDATES = [
    (1, 2048, 4, 1, False),
    (2, 2048, 8, 1, False),
    (4, 2048, 8, 1, False),
    (4, 1024, 8, 2, False),
    (8, 1024, 8, 2, False),
    (2, 512, 2, 3, False),
    (4, 256, 2, 4, False),
    (16, 1024, 8, 2, True),
]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16  # Qwen3-0.6B's attention, our block size


def graph_us(fn: Callable[[], object], per_call: int) -> float:
    """µs per launch: `fn` (which makes `per_call` launches) captured in a CUDA graph and
    replayed (as the start-up choice of the small-step linears times them)."""
    from compute_plane.kernels.fused_linear import _graph_us

    return _graph_us(fn, reps=1, iters=20) / per_call


def clock_us(fn: Callable[[], object], per_call: int, iters: int = 1) -> float:
    """µs per launch by the host's clock (the interpreter: a test of the plumbing only)."""
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e6 / (iters * per_call)


def _config_dict(c: Any) -> dict[str, Any]:
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def _each(fn: Callable[..., object], config: Any, ws: list[torch.Tensor]) -> None:
    for w in ws:
        fn(config, w)


def linears(
    shapes: list[tuple[str, str, int, int]],
    layers: int,
    timer: Callable[[Callable[[], object], int], float],
    dtype: torch.dtype,
    device: str,
    configs: list[Any] | None = None,
) -> dict[str, Any]:
    """Each projection at 1 row, every config and the separate kernels (see the module)."""
    import triton

    from compute_plane.kernels import fused_linear as fl

    if configs is None:
        configs = fl._configs(True) + [
            triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PRELOAD": p}, num_warps=w, num_stages=s)
            for n, k, w, s, p in CANDIDATES
        ]
    g = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    for name, op, n, k in shapes:
        row = _linear(op, n, k, layers, timer, dtype, device, configs, g)
        out[name] = row
        print(json.dumps({name: {k_: v for k_, v in row.items() if k_ != "configs"}}), flush=True)
    return out


def _linear(
    op: str,
    n: int,
    k: int,
    layers: int,
    timer: Callable[[Callable[[], object], int], float],
    dtype: torch.dtype,
    device: str,
    configs: list[Any],
    g: torch.Generator,
) -> dict[str, Any]:
    from compute_plane.kernels import fused_linear as fl
    from compute_plane.kernels.activation import silu_and_mul
    from compute_plane.kernels.rms_norm import add_rms_norm

    eps = 1e-6
    ws = [(torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype) for _ in range(layers)]
    width = 2 * k if op == "silu" else k
    x = torch.randn(1, width, device=device, generator=g).to(dtype)
    # (the residual and the norm: a layer's norm after its first; h, the new sum)
    r = torch.randn(1, k, device=device, generator=g).to(dtype) if op == "norm" else None
    norm_w = (1 + 0.1 * torch.randn(k, device=device, generator=g)).to(dtype)
    read = (n * k + width) * ws[0].element_size()  # the weights and the row
    mode = {"norm": fl.NORM, "silu": fl.SILU, "plain": fl.PLAIN}[op]

    def fused(config: Any = None, w: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
        h = torch.empty_like(r) if r is not None else None
        return fl._launch(
            mode, x, r, h, norm_w if r is not None else None, eps,
            w if w is not None else ws[0], None, k, config=config, pdl=pdl,
        )  # fmt: skip

    def separate(w: torch.Tensor) -> torch.Tensor:
        if r is not None:
            a = add_rms_norm(x, r, norm_w, eps)[0]
        else:
            a = silu_and_mul(x) if op == "silu" else x
        return torch.nn.functional.linear(a, w)

    want = separate(ws[0]).float()
    scale = float(want.abs().max())
    row: dict[str, Any] = {"op": op, "N": n, "K": k, "MB_read": round(read / 1e6, 2)}
    t = timer(lambda: [separate(w) for w in ws], layers)
    row["separate_us"] = round(t, 2)
    row["separate_GB_per_s"] = round(read / t / 1e3, 1)
    runs = []
    for c in configs:
        entry: dict[str, Any] = {"config": _config_dict(c)}
        try:
            err = float((fused(c).float() - want).abs().max())
            entry["ok"] = err <= fl.AGREE * scale
            t = timer(functools.partial(_each, fused, c, ws), layers)
            entry["us"] = round(t, 2)
            entry["GB_per_s"] = round(read / t / 1e3, 1)
        except Exception as e:  # a config this GPU's compiler refuses
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        runs.append(entry)
    good = [e for e in runs if e.get("ok")]
    if good:
        best = min(good, key=lambda e: e["us"])
        row["best"] = best
        row["best_vs_separate"] = round(row["separate_us"] / best["us"], 2)
        row["pdl"] = _pdl(fused, ws, good, want, scale, read, timer, layers)
    fused()  # the autotuner's own pick, at its first call for this shape
    tuner = fl._gemv_kernel
    if getattr(tuner, "best_config", None) is not None:
        row["autotuned"] = _config_dict(tuner.best_config)
    row["configs"] = runs
    return row


def _pdl(
    fused: Callable[..., torch.Tensor],
    ws: list[torch.Tensor],
    good: list[dict[str, Any]],
    want: torch.Tensor,
    scale: float,
    read: int,
    timer: Callable[[Callable[[], object], int], float],
    layers: int,
) -> list[dict[str, Any]] | str:
    """The fastest config, and the fastest that loads its first tile before the wait, as
    programmatic dependent launches (each may start while the one before runs): what the
    launches' gaps cost at batch 1."""
    import triton

    from compute_plane.kernels import interpreted
    from compute_plane.kernels.fused_linear import AGREE

    if interpreted() or torch.cuda.get_device_capability()[0] < 9:
        return "needs a GPU of compute capability 9.0 or later"
    picks = [min(good, key=lambda e: e["us"])]
    preload = [e for e in good if e["config"]["PRELOAD"]]
    if preload and (fastest := min(preload, key=lambda e: e["us"])) is not picks[0]:
        picks.append(fastest)
    out = []
    for e in picks:
        cfg = dict(e["config"])
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        c = triton.Config(cfg, num_warps=warps, num_stages=stages)
        entry: dict[str, Any] = {"config": e["config"], "without_us": e["us"]}
        try:
            err = float((fused(c, pdl=True).float() - want).abs().max())
            entry["ok"] = err <= AGREE * scale
            t = timer(functools.partial(_each, functools.partial(fused, pdl=True), c, ws), layers)
            entry["us"] = round(t, 2)
            entry["GB_per_s"] = round(read / t / 1e3, 1)
        except Exception as ex:  # a driver or graph capture that refuses the launch
            entry["error"] = f"{type(ex).__name__}: {ex}"[:300]
        out.append(entry)
    print(json.dumps({"pdl": out}), flush=True)
    return out


def attention(
    contexts: tuple[int, ...],
    layers: int,
    timer: Callable[[Callable[[], object], int], float],
    dtype: torch.dtype,
    device: str,
    graph_splits: int,
) -> list[dict[str, Any]]:
    """Decode attention of 1 sequence by split count, whole and its combine alone."""
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    for ctx in contexts:
        rows += _attention(ctx, layers, timer, dtype, device, graph_splits, g)
    return rows


def _attention(
    ctx: int,
    layers: int,
    timer: Callable[[Callable[[], object], int], float],
    dtype: torch.dtype,
    device: str,
    graph_splits: int,
    g: torch.Generator,
) -> list[dict[str, Any]]:
    import triton

    from compute_plane.kernels.decode_attention import (
        _combine,
        context_tile,
        paged_decode_attention,
    )

    nblocks = -(-ctx // BLOCK)
    caches = []
    for _ in range(layers):
        kc = torch.randn(nblocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, generator=g)
        caches.append((kc.to(dtype), torch.randn_like(kc).to(dtype)))
    perm = 1 + torch.randperm(nblocks, device=device, generator=g)
    table = perm.view(1, nblocks).to(torch.int32)
    lens = torch.full((1,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(1, HEADS, HEAD_DIM, device=device, generator=g).to(dtype)
    out = torch.empty_like(q)
    read = 2 * ctx * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
    scale = HEAD_DIM**-0.5
    want = paged_decode_attention(q, *caches[0], table, lens, scale, 1).float()

    def run(splits: int, native: bool | None) -> None:
        for kc, vc in caches:
            paged_decode_attention(q, kc, vc, table, lens, scale, splits, out=out, native=native)

    def combine(parts: torch.Tensor, lse: torch.Tensor) -> None:
        splits = parts.shape[2]
        for _ in range(layers):
            # (at this context only the splits that start before its end are read)
            block_d = triton.next_power_of_2(HEAD_DIM)
            _combine[(1, HEADS)](
                parts, lse, out, lens, 0, parts.stride(0), parts.stride(1), parts.stride(2),
                out.stride(0), out.stride(1), NUM_HEADS=HEADS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                BLOCK_N=context_tile(block_d),
            )  # fmt: skip

    rows = []
    for splits in sorted({1, 2, 4, 8, 16, graph_splits}):
        got = paged_decode_attention(q, *caches[0], table, lens, scale, splits)
        t = timer(functools.partial(run, splits, None), layers)
        entry: dict[str, Any] = {
            "context": ctx,
            "splits": splits,
            "us": round(t, 2),
            "GB_per_s": round(read / t / 1e3, 1),
            "max_abs_diff": round(float((got.float() - want).abs().max()), 5),
        }
        if dtype != torch.float32:  # the dots on fp32 copies (tf32), as before 2026-11-26
            entry["fp32_copies_us"] = round(timer(functools.partial(run, splits, False), layers), 2)
        if splits > 1:
            parts = torch.randn(1, HEADS, splits, HEAD_DIM, device=device, generator=g)
            lse = torch.randn(1, HEADS, splits, device=device, generator=g)
            entry["combine_us"] = round(timer(functools.partial(combine, parts, lse), layers), 2)
        rows.append(entry)
        print(json.dumps(entry), flush=True)
    return rows


PARTS = ("linears", "attention")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="operand copies timed in turn")
    ap.add_argument("--shapes", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--max-model-len", type=int, default=40960, help="sizes the graphs' splits")
    ap.add_argument("--parts", default=",".join(PARTS), help="of: " + ", ".join(PARTS))
    ap.add_argument("--out", type=Path, default=Path("docs/perf/gpu_variants.json"))
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):  # (a typo measured nothing, silently)
        ap.error(f"--parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})")
    on_gpu = torch.cuda.is_available()
    from compute_plane.kernels import interpreted

    if not on_gpu and not interpreted():
        raise SystemExit("benchmarks.gpu_variants needs a CUDA device (or TRITON_INTERPRET=1)")
    from compute_plane.kernels.decode_attention import choose_num_splits

    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32  # (the interpreter: fp32)
    timer = graph_us if on_gpu else clock_us
    sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 132
    graph_splits = choose_num_splits(1, KV_HEADS, args.max_model_len, sms)
    report: dict[str, Any] = {
        "benchmark": "gpu_variants",
        "machine": machine(),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (interpreter)",
        "layers": args.layers,
        "graph_splits_at_batch_1": graph_splits,
    }
    if on_gpu:
        from benchmarks.gpu import copy_bandwidth

        report["copy_bandwidth_GB_per_s"] = round(copy_bandwidth() / 1e9, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if "linears" in parts:
        report["linears"] = linears(SHAPES[args.shapes], args.layers, timer, dtype, device)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if "attention" in parts:
        contexts = tuple(int(c) for c in args.contexts.split(","))
        report["attention"] = attention(contexts, args.layers, timer, dtype, device, graph_splits)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
