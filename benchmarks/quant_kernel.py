"""The quantized CPU linear (csrc/quant_linear_cpu.c) at the bundled model's shapes.

    python -m benchmarks.quant_kernel                       # writes docs/perf/quant_kernel.json
    python -m benchmarks.quant_kernel --compare-ref 34092aa # and that revision's kernel beside it
    python -m benchmarks.quant_kernel --activations fp32 --out docs/perf/quant_kernel_fp32.json

For each layer shape of SmolLM2-135M (q|k|v, o, gate|up, down in Q4_1's q4 layout; the
tied lm_head in q8) and each number of rows: the kernel with int16 activations (or
`--activations fp32`, exact, as `--cpu-activations fp32` serves), the same
weight dequantized + oneDNN's fp32 GEMM (what a dense model runs), and with
`--compare-ref` the kernel of a git revision (built from `git show REV:...` with the same
compiler flags, fed the row layout and scales that revision takes; a revision before the
blocked layout also refuses more than 128 rows). Random codes and scales, the scales in
fp16 as the bundled model's load (`--scales fp32`: as Q4_K's): the kernel's time does
not depend on the values. Median of repeated calls, alternated; GMAC/s = rows * N * K /
time. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.workload import ROOT, machine, unknown_revision, write_report
from compute_plane.model import onednn_linear
from compute_plane.native import COMPILE_FLAGS, LINK_FLAGS
from compute_plane.quant import QuantWeight

SHAPES = {  # name: (kind, K, N)
    "qkv": ("q4", 576, 960),
    "o": ("q4", 576, 576),
    "gate_up": ("q4", 576, 3072),
    "down": ("q4", 1536, 576),
    "lm_head": ("q8", 576, 49152),
}


def _weight(kind: str, k: int, n: int, rng: np.random.Generator, half: bool) -> QuantWeight:
    if kind == "q4":
        codes = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        scales = rng.standard_normal((n, k // 32, 2)).astype(np.float32) * 0.05
    else:
        codes = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
        scales = rng.standard_normal((n, k // 32)).astype(np.float32) * 0.01
    if half:  # values fp16 holds: packed with fp16 scales
        scales = scales.astype(np.float16).astype(np.float32)
    w = QuantWeight.pack(kind, torch.from_numpy(codes), torch.from_numpy(scales))
    assert w.half == half
    return w


def _build_ref(rev: str, out_dir: Path) -> tuple[ctypes.CDLL, bool, bool]:
    """csrc/quant_linear_cpu.c as it was at `rev`, built as native.py builds it; whether
    it takes the blocked ("x16") layout of today's kernel, and fp16 scales."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:compute_plane/csrc/quant_linear_cpu.c"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    c, obj, lib = out_dir / "ref.c", out_dir / "ref.o", out_dir / "ref.so"
    c.write_text(src)
    subprocess.run(["cc", *COMPILE_FLAGS, str(c), "-o", str(obj)], check=True)
    subprocess.run(["cc", str(obj), "-o", str(lib), *LINK_FLAGS], check=True)
    dll = ctypes.CDLL(str(lib))
    takes_half = "int half" in src
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("q4_linear_f32", "q8_linear_f32"):
        fn = getattr(dll, name)
        fn.argtypes = [ptr, i64, i64, ptr, ptr, *([ctypes.c_int] if takes_half else [])]
        fn.argtypes += [ptr, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    return dll, 'Layout ("x16")' in src, takes_half


def _ref_call(
    ref: tuple[ctypes.CDLL, bool, bool], w: QuantWeight, x: torch.Tensor, exact: bool
) -> Callable[[], object] | None:
    """The reference kernel on the layout it takes, or None where it refuses the shape."""
    dll, blocked, takes_half = ref
    if takes_half:
        codes, scales = w.codes, w.scales
    else:  # fp32 scales, blocked or in rows
        codes, scales = (w.codes, w.scales.float()) if blocked else w.rows()
    n, k = w.shape
    y = torch.empty(x.shape[0], n)
    fn = dll.q4_linear_f32 if w.kind == "q4" else dll.q8_linear_f32
    half = (w.half,) if takes_half else ()

    def call() -> int:
        args = (x.data_ptr(), x.shape[0], k, codes.data_ptr(), scales.data_ptr(), *half, None)
        return int(fn(*args, y.data_ptr(), n, int(exact)))

    return call if call() == 0 else None


def _dequantize_gemm(w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    return onednn_linear(x, w.dequantize(), None)


def _time(fns: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Median seconds per call of each, calls alternated until the budget is spent."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or min(map(len, times.values())) < 5:
        for name, f in fns.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,5,8,16,32,128,512,2048")
    ap.add_argument("--compare-ref", default=None, help="git revision of the 'before' kernel")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per shape and row count")
    ap.add_argument("--activations", choices=("int16", "fp32"), default="int16")
    ap.add_argument("--scales", choices=("fp16", "fp32"), default="fp16")
    ap.add_argument("--out", type=Path, default=Path("docs/perf/quant_kernel.json"))
    args = ap.parse_args(argv)
    if args.compare_ref and (why := unknown_revision(args.compare_ref)):
        ap.error(f"--compare-ref: {why}")
    rng = np.random.default_rng(0)
    tmp = tempfile.TemporaryDirectory()
    ref = _build_ref(args.compare_ref, Path(tmp.name)) if args.compare_ref else None
    results: list[dict[str, Any]] = []
    act = args.activations
    for name, (kind, k, n) in SHAPES.items():
        w = _weight(kind, k, n, rng, args.scales == "fp16")
        dense = w.dequantize()
        for m in map(int, args.rows.split(",")):
            if name == "lm_head" and m > 32:
                continue  # only the sampled rows meet the lm_head
            x = torch.randn(m, k)
            # The kernel computes what it is timed for: the dense product, to int16 rounding.
            err = (w.linear(x, None, act) - onednn_linear(x, dense, None)).abs().max().item()
            assert err < 1e-3 * (1 + x.abs().max().item() * dense.abs().max().item() * k**0.5)
            fns: dict[str, Callable[[], object]] = {
                "kernel": functools.partial(w.linear, x, None, act),
                "dequantize_gemm": functools.partial(_dequantize_gemm, w, x),
                "gemm_dense": functools.partial(onednn_linear, x, dense, None),
            }
            if ref is not None and (call := _ref_call(ref, w, x, act == "fp32")) is not None:
                fns["ref_kernel"] = call
            secs = _time(fns, args.budget)
            row: dict[str, Any] = {"shape": name, "kind": kind, "k": k, "n": n, "rows": m}
            for f, s in secs.items():
                row[f"{f}_us"] = round(s * 1e6, 1)
                row[f"{f}_gmac_s"] = round(m * n * k / s / 1e9, 1)
            if "ref_kernel" in secs:
                row["speedup_vs_ref"] = round(secs["ref_kernel"] / secs["kernel"], 2)
            results.append(row)
            print(
                f"{name:8} rows={m:5}  "
                + "  ".join(f"{f} {s * 1e6:9.1f} us" for f, s in secs.items())
                + (f"  x{row['speedup_vs_ref']} vs ref" if "speedup_vs_ref" in row else ""),
                flush=True,
            )
    report = {
        "machine": machine(),
        "compare_ref": args.compare_ref,
        "activations": act,
        "scales": args.scales,
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }
    write_report(args.out, report)
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
