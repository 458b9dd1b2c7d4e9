"""Online serving benchmark: an OpenAI-API load generator (async HTTP, streaming).

    python -m benchmarks.online --launch                      # start the stack, run the sweeps
    python -m benchmarks.online --url http://host:8000 --rate 4 --arrival poisson
    python -m benchmarks.online --launch --workload prefix --compare-prefix-caching

Arrivals: sequential (one after another), burst (all at once), fixed (every 1/rate s)
or poisson (exponential gaps, mean 1/rate), with an optional --max-concurrency cap.
Per request: TTFT (to the first streamed token), TPOT ((e2e - TTFT) / (tokens - 1)),
ITL (gaps between streamed chunks) and end-to-end latency; per run: request and token
throughput and goodput (requests/s meeting --slo-ttft-ms and --slo-tpot-ms). With a
control plane address (given, or --launch), KV memory waste is sampled during the run:
a --control that does not answer ModelInfo is a usage error before anything runs, and
one that stops answering mid-run ends the sampling only (why, in the run's
`kv_waste_error`; `kv_waste` is of the samples taken before).

Workloads (random token ids, EOS ignored, seeded): `random` (lengths of --preset),
`chunked-prefill` (75% long prompts of 1024-1536 tokens, 25% short), and `prefix`
(a shared ~1k-token prefix plus a short distinct suffix, for the prefix cache).

The report is written after each run: a sweep stopped or failing part way keeps the runs
it made (`unfinished`: those not made, e.g. `rate=0.5`, `prefix_caching=off/single`;
`failed`: the one that raised, or the `warm-up` or `launch` before them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
from tqdm import tqdm

from benchmarks.workload import PRESETS, ReportParts, Request, machine, make_workload
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc

ARRIVALS = ("sequential", "burst", "fixed", "poisson")
WORKLOADS = ("random", "chunked-prefill", "prefix")


def build_workload(kind: str, n: int, preset: str, seed: int) -> list[Request]:
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randint(100, 40000) for _ in range(k)]

    if kind == "random":  # (n requests of the preset's lengths, its first ones the same)
        return make_workload(
            replace(PRESETS[preset], num_requests=n or PRESETS[preset].num_requests), seed
        )
    if kind == "chunked-prefill":
        return [
            Request(
                tokens(rng.randint(1024, 1536) if rng.random() < 0.75 else rng.randint(32, 128)),
                rng.randint(16, 64),
            )
            for _ in range(n or 32)
        ]
    prefix = tokens(1024)
    return [
        Request(prefix + tokens(rng.randint(16, 48)), rng.randint(16, 32)) for _ in range(n or 32)
    ]


@dataclass
class Sample:
    sent: float
    first: float | None = None
    done: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.done is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)


async def one_request(http: httpx.AsyncClient, model: str, r: Request) -> Sample:
    body = {
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    s = Sample(sent=time.perf_counter())
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                s.error = f"HTTP {resp.status_code}"
                await resp.aread()
                return s
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in event:
                    s.error = event["error"]["message"]
                elif event.get("usage"):
                    s.tokens = int(event["usage"]["completion_tokens"])
                elif any(c.get("text") for c in event["choices"]):
                    s.first = s.first or now
                    s.chunk_times.append(now)
        s.done = time.perf_counter()
    except httpx.HTTPError as e:
        s.error = repr(e)
    return s


def served_model(url: str) -> str:
    """The model the gateway at `url` serves (the first of its /v1/models), or ValueError
    saying why there is none to ask: nothing listening, not a URL, not an OpenAI API."""
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise ValueError(f"GET /v1/models failed: {e or type(e).__name__}") from None
    if resp.status_code != 200:
        raise ValueError(f"GET /v1/models answered HTTP {resp.status_code}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError):
        raise ValueError("GET /v1/models answered no OpenAI model list") from None


def arrival_gaps(kind: str, n: int, rate: float, seed: int) -> Iterator[float]:
    rng = random.Random(seed + 1)
    for _ in range(n):
        if kind == "poisson":
            yield rng.expovariate(rate)
        elif kind == "fixed":
            yield 1.0 / rate
        else:
            yield 0.0


def kv_waste(control: str) -> float | None:
    """The share of the allocated KV slots the control plane at `control` holds unused
    (None: none allocated), or ValueError saying why it cannot be read."""
    try:
        with grpc.insecure_channel(control) as ch:
            st = (
                pb_grpc.ControlPlaneStub(ch)
                .ModelInfo(pb.ModelInfoRequest(detailed=True), timeout=5)
                .stats
            )
    except grpc.RpcError as e:
        said = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else repr(e)
        raise ValueError(f"ModelInfo failed: {said}") from None
    if not st.num_kv_slots_allocated:
        return None
    return 1.0 - st.num_kv_slots_used / st.num_kv_slots_allocated


@dataclass
class KvSamples:
    """A run's samples of the KV waste; `error`: why sampling stopped before the run ended."""

    waste: list[float] = field(default_factory=list)
    error: str | None = None


async def run(
    url: str,
    work: list[Request],
    arrival: str,
    rate: float,
    max_concurrency: int | None,
    control: str | None,
    seed: int,
    progress: bool = True,
) -> tuple[list[Sample], float, KvSamples]:
    limit = asyncio.Semaphore(max_concurrency or len(work))
    kv = KvSamples()
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        bar = tqdm(
            total=len(work), disable=None if progress else True, desc=f"{arrival} rate={rate}"
        )

        async def limited(r: Request) -> Sample:
            async with limit:
                s = await one_request(http, model, r)
            bar.update(1)
            return s

        async def sample_kv(stop: asyncio.Event) -> None:
            while control and not stop.is_set():
                try:
                    w = await asyncio.to_thread(kv_waste, control)
                except Exception as e:  # (the run goes on: its figures are not the sampler's)
                    kv.error = str(e) if isinstance(e, ValueError) else repr(e)
                    return
                if w is not None:
                    kv.waste.append(w)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)

        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_kv(stop))
        start = time.perf_counter()
        tasks = []
        for r, gap in zip(work, arrival_gaps(arrival, len(work), rate, seed), strict=True):
            if arrival == "sequential":
                tasks.append(asyncio.ensure_future(limited(r)))
                await tasks[-1]
                continue
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(r)))
        samples = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        stop.set()
        await sampler
        bar.close()
    return samples, duration, kv


def _dist(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(x * 1000 for x in xs)

    def pct(p: float) -> float:
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 2)

    return {
        "mean": round(statistics.fmean(xs), 2),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
    }


def summarize(
    samples: list[Sample],
    work: list[Request],
    duration: float,
    kv: KvSamples,
    slo: tuple[float, float],
) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None and s.done is not None]
    out_tokens = sum(s.tokens for s in ok)
    prompt_tokens = sum(len(r.prompt) for r, s in zip(work, samples, strict=True) if s in ok)
    itl = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:], strict=False)]
    good = [
        s
        for s in ok
        if (s.ttft or 0) * 1000 <= slo[0] and (s.tpot is None or s.tpot * 1000 <= slo[1])
    ]
    return {
        "requests": len(samples),
        "completed": len(ok),
        "errors": sorted({s.error for s in samples if s.error}),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((out_tokens + prompt_tokens) / duration, 2),
        "goodput": round(len(good) / duration, 3),
        "slo_ms": {"ttft": slo[0], "tpot": slo[1]},
        "ttft_ms": _dist([s.ttft for s in ok if s.ttft is not None]),
        "tpot_ms": _dist([s.tpot for s in ok if s.tpot is not None]),
        "itl_ms": _dist(itl),
        "e2e_ms": _dist([s.e2e for s in ok if s.e2e is not None]),
        "kv_waste": (
            {
                "mean": round(statistics.fmean(kv.waste), 4),
                "max": round(max(kv.waste), 4),
                "samples": len(kv.waste),
            }
            if kv.waste
            else None
        ),
        # (why sampling stopped before the run ended: the figures above are of the samples
        # taken before)
        "kv_waste_error": kv.error,
    }


@contextlib.contextmanager
def launched(
    model: str, control_args: tuple[str, ...] = (), compute_args: tuple[str, ...] = ()
) -> Iterator[tuple[str, str]]:
    """Compute + control + gateway on loopback; yields (gateway URL, control address)."""
    from hetero_infer.local import child, free_port, stop_process, wait_http_ready

    kport, cport, gport = free_port(), free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{cport}"
    quiet = ("--log-level", "WARNING")
    k = [*quiet, "compute-plane", "--model", model, "--port", str(kport), "--metrics-port", "-1"]
    k += compute_args
    c = [*quiet, "control-plane", "--model", model, "--port", str(cport), "--compute", compute]
    c += ["--metrics-port", "-1", *control_args]
    with child(k, compute), child(c, control):
        cmd = [sys.executable, "-m", "hetero_infer.cli", *quiet, "gateway", "--port", str(gport)]
        gw = subprocess.Popen([*cmd, "--control", control])
        url = f"http://127.0.0.1:{gport}"
        try:
            wait_http_ready(url + "/ready", gw)
            yield url, control
        finally:
            stop_process(gw)


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rates = [r for r in report["runs"] if r["sweep"] == "rate"]
    if rates:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["rate"] for r in rates]
        for key, label in (("ttft_ms", "TTFT"), ("e2e_ms", "end-to-end"), ("tpot_ms", "TPOT")):
            ax.plot(xs, [r[key]["p50"] for r in rates], marker="o", label=f"{label} p50")
            ax.plot(xs, [r[key]["p99"] for r in rates], marker="x", ls="--", label=f"{label} p99")
        ax.set(
            xlabel="request rate (req/s, Poisson)",
            ylabel="latency (ms)",
            yscale="log",
            title="Latency vs request rate",
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "online_latency_vs_rate.png"
        fig.savefig(path, dpi=120)
        files.append(str(path))
    conc = [r for r in report["runs"] if r["sweep"] == "concurrency"]
    if conc:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["max_concurrency"] for r in conc]
        ax.plot(xs, [r["output_token_throughput"] for r in conc], marker="o", label="output tok/s")
        ax.plot(xs, [r["total_token_throughput"] for r in conc], marker="s", label="total tok/s")
        ax.set(
            xlabel="max concurrency (burst arrivals)",
            ylabel="tokens / s",
            xscale="log",
            title="Throughput vs concurrency",
        )
        # Ticks at the measured caps only (log-scale minor labels run into each other).
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.legend()
        fig.tight_layout()
        path = out_dir / "online_throughput_vs_concurrency.png"
        fig.savefig(path, dpi=120)
        files.append(str(path))
    return files


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="gateway base URL (else --launch)")
    ap.add_argument("--control", help="control plane address, to sample KV waste")
    ap.add_argument("--launch", action="store_true", help="start the three planes locally")
    ap.add_argument("--model", default="default")
    ap.add_argument("--workload", default="random", choices=WORKLOADS)
    ap.add_argument(
        "--preset",
        default="default",
        choices=sorted(PRESETS),
        help="lengths for the random workload",
    )
    ap.add_argument("--num-requests", type=int, default=0, help="0: the workload's default")
    ap.add_argument("--arrival", default="poisson", choices=ARRIVALS)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (fixed, poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--rates", default="", help="sweep: comma-separated Poisson rates")
    ap.add_argument("--concurrencies", default="", help="sweep: comma-separated caps (burst)")
    ap.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="with --launch: run twice, prefix caching on and off; TTFT ratio",
    )
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/perf/online.json"))
    ap.add_argument("--no-progress", action="store_true")
    return ap


_SHOWN = ("arrival", "rate", "max_concurrency", "completed", "output_token_throughput")


class _Sessions:
    """The runs of one invocation: a session per stack (two with prefix caching on/off),
    each a warm-up and then the sweep's runs, appended to `report["runs"]`, the report
    written after each run (`ReportParts`: a part per run, named as `_sweep` names it,
    after its session's prefix)."""

    def __init__(self, args: argparse.Namespace, report: dict[str, Any]) -> None:
        self.args, self.report = args, report
        self.runs_started = 0
        self.sweep = _sweep(args)
        prefixes = list(_PREFIX_CACHING.values()) if args.compare_prefix_caching else [""]
        names = [prefix + part for prefix in prefixes for part, *_ in self.sweep]
        self.parts = ReportParts(args.out, report, names)

    def one(
        self, url: str, control: str | None, arrival: str, rate: float, cap: int | None
    ) -> dict[str, Any]:
        a = self.args
        # Each run of a sweep draws fresh prompts (same lengths distribution): a prompt
        # repeated from an earlier run would hit the prefix cache and flatter TTFT.
        seed = a.seed + 1000 * self.runs_started
        self.runs_started += 1
        work = build_workload(a.workload, a.num_requests, a.preset, seed)
        samples, duration, kv = asyncio.run(
            run(url, work, arrival, rate, cap, control, seed, not a.no_progress)
        )
        r = {"arrival": arrival, "rate": rate, "max_concurrency": cap}
        r |= summarize(samples, work, duration, kv, (a.slo_ttft_ms, a.slo_tpot_ms))
        shown = (*_SHOWN, "ttft_ms", "kv_waste", *(("kv_waste_error",) if kv.error else ()))
        print(json.dumps({k: r[k] for k in shown}))
        return r

    def session(self, url: str, control: str | None, tag: dict[str, Any], prefix: str = "") -> None:
        a, runs = self.args, self.report["runs"]
        # Unrecorded warm-up: the first steps of a fresh process pay for allocator
        # growth and first-touch page faults, which would land on the first run only.
        warm = build_workload(a.workload, 4, a.preset, a.seed + 999_999)
        with self.parts.failing(prefix + "warm-up"):
            asyncio.run(run(url, warm, "burst", 0.0, None, None, a.seed, False))
        self.runs_started = 0  # the same prompts in each session (prefix caching on / off)
        for part, sweep, arrival, rate, cap in self.sweep:
            with self.parts.part(prefix + part):
                runs.append({"sweep": sweep, **tag, **self.one(url, control, arrival, rate, cap)})

    def launched(
        self,
        control_args: tuple[str, ...] = (),
        tag: dict[str, Any] | None = None,
        prefix: str = "",
    ) -> None:
        """A session on a stack of its own (its start or stop failing: `{prefix}launch`)."""
        model = self.args.model
        with self.parts.failing(prefix + "launch"), launched(model, control_args) as (url, control):
            self.session(url, control, tag or {}, prefix)

    def compare_prefix_caching(self) -> None:
        for on in (True, False):
            flag = "--enable-prefix-caching" if on else "--no-enable-prefix-caching"
            self.launched((flag,), {"prefix_caching": on}, _PREFIX_CACHING[on])
        ttft = {r["prefix_caching"]: (r["ttft_ms"] or {}).get("p50") for r in self.report["runs"]}
        off, on_ = ttft.get(False), ttft.get(True)
        if not (off and on_):  # (a session with no request done)
            self.report["ttft_p50_ratio_off_vs_on"] = None
            print(f"TTFT p50: no ratio, a session finished no request: {ttft}")
            return
        self.report["ttft_p50_ratio_off_vs_on"] = round(off / on_, 2)
        print(f"TTFT p50: caching off / on = {self.report['ttft_p50_ratio_off_vs_on']}x")


_PREFIX_CACHING = {True: "prefix_caching=on/", False: "prefix_caching=off/"}


def _sweep(args: argparse.Namespace) -> list[tuple[str, str, str, float, int | None]]:
    """A session's runs: (part name, sweep, arrival, rate, max concurrency) each."""
    rates = [float(x) for x in args.rates.split(",") if x]
    caps = [int(x) for x in args.concurrencies.split(",") if x]
    runs: list[tuple[str, str, str, float, int | None]]
    runs = [(f"rate={r}", "rate", "poisson", r, None) for r in rates]
    runs += [(f"concurrency={c}", "concurrency", "burst", 0, c) for c in caps]
    return runs or [("single", "single", args.arrival, args.rate, args.max_concurrency)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = _parser()
    args = ap.parse_args(argv)
    if not (args.url or args.launch):
        ap.error("give --url or --launch")
    if args.launch and args.control:
        ap.error("--control samples a stack given by --url; --launch samples its own")
    if args.compare_prefix_caching and not args.launch:
        ap.error("--compare-prefix-caching starts its own stacks: add --launch")
    try:
        rates = [float(x) for x in args.rates.split(",") if x]
        caps = [int(x) for x in args.concurrencies.split(",") if x]
    except ValueError as e:
        ap.error(f"--rates / --concurrencies: {e}")
    if not all(r > 0 and math.isfinite(r) for r in rates):
        ap.error(f"--rates must be positive numbers, got {args.rates}")
    if not all(c >= 1 for c in caps) or (args.max_concurrency or 1) < 1:
        ap.error("--concurrencies and --max-concurrency must be at least 1")
    rated = args.arrival in ("fixed", "poisson") and not (rates or caps)
    if rated and not (args.rate > 0 and math.isfinite(args.rate)):
        ap.error(f"--rate must be a positive number for --arrival {args.arrival}")
    if args.num_requests < 0:
        ap.error("--num-requests must be at least 0 (0: the workload's default)")
    if args.url and not args.launch:  # (before anything runs: a traceback at its first request)
        try:
            served_model(args.url)
        except ValueError as e:
            ap.error(f"--url {args.url}: no gateway to benchmark there: {e}")
    if args.control and not args.launch:  # (else its sampler failed after every request)
        try:
            kv_waste(args.control)
        except ValueError as e:
            ap.error(f"--control {args.control}: no control plane to sample there: {e}")
    work = build_workload(args.workload, args.num_requests, args.preset, args.seed)
    report: dict[str, Any] = {
        "benchmark": "online",
        "workload": args.workload,
        "num_requests": len(work),
        "machine": machine(),
        "runs": [],
    }
    sessions = _Sessions(args, report)
    if args.compare_prefix_caching:
        sessions.compare_prefix_caching()
    elif args.launch:
        sessions.launched()
    else:
        sessions.session(args.url, args.control, {})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report["plots"] = plot(report, args.out.parent) if not args.compare_prefix_caching else []
    sessions.parts.write()
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
