"""One decode step of the bundled model on the CPU: its time and where it goes.

    python -m benchmarks.decode_step                          # torch vs cpu backend, profiles
    python -m benchmarks.decode_step --quantization none      # the weights dequantized to fp32
    python -m benchmarks.decode_step --compare-ref 736fb2c~1  # and the torch attention of a commit
    python -m benchmarks.decode_step --shapes 1x300 --compare-scales 40  # fp16 vs fp32 scales

The weights are what the compute plane runs (`--quantization`, as its flag: `auto` by
default, a quantized GGUF's matrices kept quantized on their C kernels; `none`: dense
fp32), and so is the step: with the cpu backend and quantized layer matrices, a decode
step runs in one C call (compute_plane/decode_cpu.py), as it does served. The report
records both (`quantization`, `weights`, each row's `fused`).

Runs the model's forward and lm_head for B decodes at context C over a KV cache whose
blocks are scattered, as in a long-running server, with the torch backend (gather +
SDPA) and the cpu backend (C kernel reading blocks in place), and profiles each; then,
with dense weights, the cpu backend's step with the projections by MKL (F.linear) and by
oneDNN (quantized matrices run on their own kernels whichever is set). `--compare-ref` loads
`compute_plane/attention/torch_backend.py` (before: `compute_plane/attention.py`) as it was at a git revision (through `git show`) and
times the same step with it: the before/after of an attention change. `--prefills`
times the prefill of one prompt of N tokens with nothing cached (forward + lm_head of
its last row) with each backend, alternated, best of two. `--compare-scales ROUNDS`
times only the decode shapes' step (cpu backend), with the weights as loaded (scales in
fp16 where exact) and with the same weights' scales widened to fp32, alternated.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.workload import ROOT, machine, unknown_revision, write_report
from compute_plane import quant
from compute_plane.attention import AttentionMetadata, TorchPagedAttention
from compute_plane.attention.factory import model_kernels
from compute_plane.config import ComputeConfig
from compute_plane.decode_cpu import FusedDecode
from compute_plane.device import resolve_quantization
from compute_plane.engine import load_for
from compute_plane.kv_cache import KVCache
from compute_plane.model import Model, onednn_linear, with_quantized
from hetero_common.model_path import resolve_model_path

LINEARS = {"mkl": F.linear, "onednn": onednn_linear}
CATEGORIES = {
    "matmul": (
        "aten::mm",
        "aten::addmm",
        "aten::linear",
        "aten::matmul",
        "aten::bmm",
        "mkldnn::_linear_pointwise",
    ),
    "kv gather": ("aten::index_select", "aten::index", "aten::take"),
    "attention (SDPA)": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
    "kv write": ("aten::index_copy", "aten::index_put"),
    "attention (C kernel)": ("cpu_decode_attention",),
    # (C calls the profiler cannot see: named around them while profiling, _named_kernels)
    "quantized matmul (C kernel)": ("quantized_linear",),
    "fused decode step (C kernel)": ("fused_decode",),
}


def _old_attention(ref: str) -> Any:
    for where in ("compute_plane/attention/torch_backend.py", "compute_plane/attention.py"):
        show = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:{where}"], capture_output=True, text=True
        )
        if show.returncode == 0:  # the package's file, or the module it was before
            break
    else:
        raise SystemExit(f"--compare-ref {ref}: the revision has no torch attention to load")
    src = show.stdout
    path = Path(tempfile.mkdtemp()) / "attention_at_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("attention_at_ref", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module.TorchPagedAttention


BS = 16  # tokens per KV block


def _named_kernels(model: Model) -> Callable[[], None]:
    """Name the quantized matmuls and the fused decode step (C calls through ctypes, which
    the profiler does not see) in its trace; returns what puts the model back."""
    linear, fused = model.linear, model.fused

    def named_linear(x: torch.Tensor, w: Any, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(w, quant.QuantWeight):  # (torch ops, seen as they are)
            return linear(x, w, bias)
        with torch.profiler.record_function("quantized_linear"):
            return linear(x, w, bias)

    class NamedFused:
        max_rows = FusedDecode.max_rows

        def __call__(self, *args: Any) -> torch.Tensor:
            assert fused is not None
            with torch.profiler.record_function("fused_decode"):
                return fused(*args)

    model.linear = named_linear
    if fused is not None:
        model.fused = NamedFused()  # type: ignore[assignment]

    def restore() -> None:
        model.linear, model.fused = linear, fused

    return restore


def _profile(model: Model, step: Callable[[], None]) -> dict[str, float]:
    """Share of one step's CPU time per category (CATEGORIES)."""
    restore = _named_kernels(model)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
    finally:
        restore()
    share: dict[str, float] = defaultdict(float)
    total = 0.0
    for ev in prof.key_averages():
        total += ev.self_cpu_time_total
        cat = next((k for k, names in CATEGORIES.items() if ev.key.startswith(names)), "other")
        share[cat] += ev.self_cpu_time_total
    return {k: round(v / total, 3) for k, v in sorted(share.items())}


def _decode_step(cfg: Any, b: int, c: int) -> Callable[[Model], None]:
    """What runs a decode step of `b` sequences at context `c` on a model, over a cache
    whose blocks are scattered (the metadata built per step, as the engine does)."""
    nb = -(-c // BS)
    cache = KVCache(cfg, b * nb + 1, BS, torch.float32, torch.device("cpu"))
    ids = list(range(1, b * nb + 1))
    random.Random(0).shuffle(ids)
    tables = torch.tensor(ids, dtype=torch.int32).view(b, nb)
    slots = tables[:, (c - 1) // BS].long() * BS + (c - 1) % BS
    tokens, pos = torch.randint(100, 1000, (b,)), torch.full((b,), c - 1)

    def run(model: Model) -> None:
        meta = AttentionMetadata.decodes(slots, tables, [c] * b, BS)
        model.logits(model.forward(tokens, pos, meta, cache.layers))

    return run


def _decode_row(model: Model, cfg: Any, backends: dict[str, Any], b: int, c: int) -> dict[str, Any]:
    """A decode step of `b` sequences at context `c`, blocks scattered over the cache:
    each attention backend (the cpu one by the fused step where the compute plane would
    take it), each linear kernel (dense weights), and a profile of the two backends."""
    run = _decode_step(cfg, b, c)

    def step() -> None:
        run(model)

    def timed() -> float:
        times = []
        for _ in range(6):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return round(statistics.median(times[1:]) * 1e3, 1)

    fused = model.fused  # (the cpu backend's, built with the model where it applies)

    def use(name: str) -> None:
        model.attention = backends[name]
        model.fused = fused if name == "cpu" else None

    row: dict[str, Any] = {"batch": b, "context": c}
    row["fused"] = fused is not None and b <= fused.max_rows
    for name in backends:
        use(name)
        row[f"{name}_ms"] = timed()
    use("cpu")
    chosen = model.linear
    # Alternated, twice each: this machine's speed drifts within a run.
    for lname, lin in [*LINEARS.items()] * 2 if _weights(model) == "fp32" else []:
        model.linear = with_quantized(lin)
        key = f"cpu_{lname}_ms"
        row[key] = min(timed(), row.get(key, float("inf")))
    model.linear = chosen
    for name in ("torch", "cpu"):
        use(name)
        row[f"profile_{name}"] = _profile(model, step)
    use("cpu")
    return row


def _widened(weights: dict[str, quant.Weight]) -> dict[str, quant.Weight]:
    """The weights with every fp16 scale held in fp32 (the same values, more bytes)."""
    return {
        name: quant.QuantWeight(w.kind, w.codes, w.scales.float(), w.n, w.k)
        if isinstance(w, quant.QuantWeight) and w.half
        else w
        for name, w in weights.items()
    }


def _scales_row(models: dict[str, Model], cfg: Any, b: int, c: int, rounds: int) -> dict[str, Any]:
    """The cpu backend's decode step of each model (the same weights with their scales
    as loaded and widened to fp32), `rounds` rounds of 5 steps each, alternated: median."""
    run = _decode_step(cfg, b, c)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            run(model)  # (a warm-up step: the other model's weights were in the caches)
            for _ in range(5):
                t = time.perf_counter()
                run(model)
                times[name].append(time.perf_counter() - t)
    row: dict[str, Any] = {"batch": b, "context": c, "steps_each": 5 * rounds}
    for name, ts in times.items():
        row[f"{name}_ms"] = round(statistics.median(ts) * 1e3, 2)
    return row


def _weights(model: Model) -> str:
    """What the layers' matrices are: fp32 (dense), q4 / q8 (quantized groups of 32)."""
    kinds = {
        w.kind if isinstance(w, quant.QuantWeight) else "fp32"
        for layer in model.layers
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
    }
    return "+".join(sorted(kinds))


def _prefill_row(model: Model, cfg: Any, backends: dict[str, Any], n: int) -> dict[str, Any]:
    """A prefill of `n` prompt tokens with each backend (best of 3, alternated twice)."""
    nb = -(-n // BS)
    cache = KVCache(cfg, nb + 1, BS, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(BS, BS + n),
        block_tables=torch.arange(1, nb + 1, dtype=torch.int32).view(1, nb),
        seq_lens=[n],
        query_lens=[n],
        num_decodes=0,
        block_size=BS,
    )
    tokens, pos = torch.randint(100, 1000, (n,)), torch.arange(n)
    row: dict[str, Any] = {"prefill_tokens": n}
    for name, backend in [*backends.items()] * 2:
        model.attention = backend
        times = []
        for _ in range(3):
            t = time.perf_counter()
            hidden = model.forward(tokens, pos, meta, cache.layers)
            model.logits(hidden[-1:])
            times.append(time.perf_counter() - t)
        best = round(min(times) * 1e3, 1)
        row[f"{name}_ms"] = min(best, row.get(f"{name}_ms", float("inf")))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--quantization",
        default=ComputeConfig.quantization,
        choices=("auto", "none", "int8"),
        help="the weights, as the compute plane's flag (default: its own, auto: a quantized "
        "GGUF's matrices stay quantized)",
    )
    ap.add_argument("--shapes", default="1x300,4x300,16x300,48x300,48x600", help="BxC,...")
    ap.add_argument("--prefills", default="512,2048", help="prompt lengths to time a prefill of")
    ap.add_argument("--compare-ref", default=None, help="git revision of the 'before' attention")
    ap.add_argument(
        "--compare-scales",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only the decode shapes, the weights' scales as loaded (fp16 where exact) vs "
        "widened to fp32, alternated ROUNDS times (5 steps each)",
    )
    ap.add_argument("--out", type=Path, default=Path("docs/perf/decode_step.json"))
    args = ap.parse_args(argv)
    if args.compare_ref and (why := unknown_revision(args.compare_ref)):
        ap.error(f"--compare-ref: {why}")
    # The model as a compute plane on the CPU loads and runs it (fp32, the cpu backend's
    # kernels, the fused decode step where it applies).
    config = ComputeConfig(device="cpu", quantization=args.quantization)
    cpu = torch.device("cpu")
    try:
        mode = resolve_quantization(config.quantization, cpu, torch.float32)
    except ValueError as e:  # (int8 where the quantized kernels cannot be built)
        ap.error(str(e))
    loaded = load_for(config, resolve_model_path(args.model))
    cfg = loaded.config
    weights = quant.prepare(loaded.weights, mode, cpu)
    kernels = model_kernels("cpu", cfg, cpu)
    model = Model(
        cfg, weights, cpu, torch.float32, 4096, kernels, activations=config.cpu_activations
    )
    scale = cfg.scale
    backends: dict[str, Any] = {"torch": TorchPagedAttention(scale), "cpu": model.attention}
    if args.compare_ref:
        backends = {f"at {args.compare_ref}": _old_attention(args.compare_ref)(scale), **backends}
    report: dict[str, Any] = {"benchmark": "decode_step", "machine": machine()}
    report["threads"] = torch.get_num_threads()
    report["quantization"] = args.quantization
    report["weights"] = _weights(model)
    report["weight_mb"] = round(model.weight_bytes / 1e6, 1)
    report["steps"] = []
    if args.compare_scales:
        act = config.cpu_activations
        wide = Model(cfg, _widened(weights), cpu, torch.float32, 4096, kernels, activations=act)
        models = {"loaded": model, "fp32_scales": wide}
        report["fp32_scales_weight_mb"] = round(wide.weight_bytes / 1e6, 1)
        for shape in args.shapes.split(","):
            b, c = (int(x) for x in shape.split("x"))
            row = _scales_row(models, cfg, b, c, args.compare_scales)
            row["loaded_vs_fp32_scales"] = round(row["fp32_scales_ms"] / row["loaded_ms"], 3)
            report["steps"].append(row)
            print(json.dumps(row), flush=True)
        write_report(args.out, report)
        print(f"report: {args.out}", file=sys.stderr)
        return report
    for shape in args.shapes.split(","):
        b, c = (int(x) for x in shape.split("x"))
        report["steps"].append(row := _decode_row(model, cfg, backends, b, c))
        print(json.dumps(row), flush=True)
    report["prefills"] = []
    for n in (int(x) for x in args.prefills.split(",") if x):
        report["prefills"].append(prow := _prefill_row(model, cfg, backends, n))
        print(json.dumps(prow), flush=True)
    write_report(args.out, report)
    print(f"report: {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
