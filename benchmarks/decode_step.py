"""One decode step of the bundled model on the CPU: its time and where it goes.

    python -m benchmarks.decode_step                          # torch vs cpu backend, profiles
    python -m benchmarks.decode_step --compare-ref 736fb2c~1  # and the torch attention of a commit

Runs the model's forward and lm_head for B decodes at context C over a KV cache whose
blocks are scattered, as in a long-running server, with the torch backend (gather +
SDPA) and the cpu backend (C kernel reading blocks in place), and profiles each; then
the cpu backend's step with the projections by MKL (F.linear) and by oneDNN. `--compare-ref` loads
`compute_plane/attention/torch_backend.py` (before: `compute_plane/attention.py`) as it was at a git revision (through `git show`) and
times the same step with it: the before/after of an attention change. `--prefills`
times the prefill of one prompt of N tokens with nothing cached (forward + lm_head of
its last row) with each backend, alternated, best of two.
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
from compute_plane.attention import AttentionMetadata, TorchPagedAttention
from compute_plane.attention.cpu import CPUPagedAttention
from compute_plane.kv_cache import KVCache
from compute_plane.loader import load_model
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


def _profile(step: Callable[[], None]) -> dict[str, float]:
    """Share of one step's CPU time per category (CATEGORIES)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    share: dict[str, float] = defaultdict(float)
    total = 0.0
    for ev in prof.key_averages():
        total += ev.self_cpu_time_total
        cat = next((k for k, names in CATEGORIES.items() if ev.key.startswith(names)), "other")
        share[cat] += ev.self_cpu_time_total
    return {k: round(v / total, 3) for k, v in sorted(share.items())}


def _decode_row(model: Model, cfg: Any, backends: dict[str, Any], b: int, c: int) -> dict[str, Any]:
    """A decode step of `b` sequences at context `c`, blocks scattered over the cache:
    each attention backend, each linear kernel, and a profile of the two backends."""
    nb = -(-c // BS)
    cache = KVCache(cfg, b * nb + 1, BS, torch.float32, torch.device("cpu"))
    ids = list(range(1, b * nb + 1))
    random.Random(0).shuffle(ids)
    tables = torch.tensor(ids, dtype=torch.int32).view(b, nb)
    slots = tables[:, (c - 1) // BS].long() * BS + (c - 1) % BS
    tokens, pos = torch.randint(100, 1000, (b,)), torch.full((b,), c - 1)

    def step() -> None:  # the metadata is built per step, as the engine does
        meta = AttentionMetadata.decodes(slots, tables, [c] * b, BS)
        model.logits(model.forward(tokens, pos, meta, cache.layers))

    def timed() -> float:
        times = []
        for _ in range(6):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return round(statistics.median(times[1:]) * 1e3, 1)

    row: dict[str, Any] = {"batch": b, "context": c}
    for name, backend in backends.items():
        model.attention = backend
        row[f"{name}_ms"] = timed()
    model.attention = backends["cpu"]
    chosen = model.linear
    # Alternated, twice each: this machine's speed drifts within a run.
    for lname, lin in [*LINEARS.items()] * 2:
        model.linear = with_quantized(lin)
        key = f"cpu_{lname}_ms"
        row[key] = min(timed(), row.get(key, float("inf")))
    model.linear = chosen
    for name in ("torch", "cpu"):
        model.attention = backends[name]
        row[f"profile_{name}"] = _profile(step)
    return row


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
    ap.add_argument("--shapes", default="1x300,4x300,16x300,48x300,48x600", help="BxC,...")
    ap.add_argument("--prefills", default="512,2048", help="prompt lengths to time a prefill of")
    ap.add_argument("--compare-ref", default=None, help="git revision of the 'before' attention")
    ap.add_argument("--out", type=Path, default=Path("docs/perf/decode_step.json"))
    args = ap.parse_args(argv)
    if args.compare_ref and (why := unknown_revision(args.compare_ref)):
        ap.error(f"--compare-ref: {why}")
    loaded = load_model(resolve_model_path(args.model), progress=False)
    cfg = loaded.config
    model = Model(cfg, loaded.weights, torch.device("cpu"), torch.float32, 4096)
    scale = cfg.head_dim**-0.5
    backends: dict[str, Any] = {
        "torch": TorchPagedAttention(scale),
        "cpu": CPUPagedAttention(scale),
    }
    if args.compare_ref:
        backends = {f"at {args.compare_ref}": _old_attention(args.compare_ref)(scale), **backends}
    report: dict[str, Any] = {"benchmark": "decode_step", "machine": machine()}
    report["threads"] = torch.get_num_threads()
    report["steps"] = []
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
