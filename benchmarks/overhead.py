"""Control-plane overhead per step at 1, 64 and 256 running sequences.

    python -m benchmarks.overhead        # writes docs/perf/overhead.json

A real control plane process (scheduler, block manager, detokeniser, stop checks,
Generate streams to a gRPC client) drives benchmarks.instant_compute, which answers
every step at once. The gap between a step's result and the next step, measured on the
compute side, is what the control plane costs per step; the model's time is not in it.
Each count is measured with the control plane's --stream-interval at 1 (a message per
token, the default) and at 16 (a message per stream every 16 tokens).

Beside each figure, `in_process` splits the same loop without gRPC or processes: the
control plane's own step code (schedule, build the step, apply the result, output
processing) driven in one process against the harness's logic, each part timed. The
gap between the two is gRPC, the Generate streams and the event loop.

The report is written after each measurement (API, stream interval, count): a run
stopped or failing part way keeps those it made (`unfinished`: those not made; `failed`:
the one that raised).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.instant_compute import InstantCompute
from benchmarks.workload import ReportParts, machine
from control_plane.compute_client import InProcessLink, sampled_tokens
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.plane import ComputePlane
from control_plane.server import CallOutbox
from control_plane.tokenizer import load_tokenizer
from hetero_common.model_path import bundled_gguf
from hetero_infer.local import child, free_port, stop_process, wait_serving
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc


def _request(rng: random.Random, steps: int) -> pb.GenerateRequest:
    params = pb.GenerationParams(max_tokens=4 * steps + 4096, temperature=0, ignore_eos=True)
    prompt = [rng.randint(100, 20000) for _ in range(16)]
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=params)


async def _drive_many(control: str, num_seqs: int, steps: int, seed: int) -> None:
    """As _drive_calls, but every request on one GenerateMany call, as the gateway sends them."""
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(control) as channel:
        call = pb_grpc.ControlPlaneStub(channel).GenerateMany()
        for i in range(num_seqs):
            start = pb.GenerateManyRequest(start=_request(rng, steps), accept_packed=True)
            start.start.request_id = str(i)
            await call.write(start)
        seen = dict.fromkeys(map(str, range(num_seqs)), 0)
        after: dict[str, int] | None = None  # tokens read since all were running
        while seen:
            message = await call.read()
            assert isinstance(message, pb.GenerateManyResponse), message
            assert not message.errors, message.errors
            # Tokens per request: the full responses', then the packed deltas'.
            counts = [
                (r.request_id, sum(len(c.token_ids) for c in r.choices)) for r in message.responses
            ]
            counts += zip(message.packed.request_ids, message.packed.num_tokens, strict=True)
            for rid, got in counts:
                if rid not in seen:
                    continue
                seen[rid] += got
                if after is not None:
                    after[rid] += got
                    if after[rid] >= steps:
                        del seen[rid]
                        await call.write(pb.GenerateManyRequest(cancel=rid))
            if after is None and all(seen.values()):
                after = dict.fromkeys(seen, 0)
        call.cancel()


async def _drive_calls(control: str, num_seqs: int, steps: int, seed: int) -> None:
    """num_seqs streams decoding together for about `steps` decode steps.

    Streams open one after another (each is a Generate call the control plane admits
    as it arrives), so the measured stretch starts only once every stream has had its
    first token: from then on all `num_seqs` are running, and each stream reads
    `steps` more tokens before it hangs up.
    """
    rng = random.Random(seed)
    # One connection per 64 streams: an HTTP/2 connection carries at most 100 streams
    # at once by default, and the rest would queue client-side, never all running.
    # Channels to one target share a connection through gRPC's global subchannel pool
    # unless each has a pool of its own.
    channels = [
        grpc.aio.insecure_channel(control, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-num_seqs // 64))
    ]
    all_running = asyncio.Event()
    have_first = 0
    try:
        stubs = [pb_grpc.ControlPlaneStub(ch) for ch in channels]

        async def one(i: int) -> None:
            nonlocal have_first
            req = _request(rng, steps)
            seen = after = 0
            async for resp in stubs[i % len(stubs)].Generate(req):
                got = sum(len(c.token_ids) for c in resp.choices)
                if seen == 0 and got:
                    have_first += 1
                    if have_first == num_seqs:
                        all_running.set()
                seen += got
                if all_running.is_set():
                    after += got
                    if after >= steps:
                        return

        await asyncio.gather(*(one(i) for i in range(num_seqs)))
    finally:
        for ch in channels:
            await ch.close()


_DRIVERS = {"generate_many": _drive_many, "generate": _drive_calls}


def measure(
    num_seqs: int, steps: int, stream_interval: int = 1, api: str = "generate_many", seed: int = 0
) -> dict[str, Any]:
    kport, cport = free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{cport}"
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "gaps.json"
        cmd = [sys.executable, "-m", "benchmarks.instant_compute", "--port", str(kport)]
        harness = subprocess.Popen([*cmd, "--record", str(record)])
        try:
            wait_serving(compute, harness, timeout=60)
            args = ["--log-level", "WARNING", "control-plane", "--port", str(cport)]
            args += ["--compute", compute, "--metrics-port", "-1", "--max-num-seqs", "256"]
            args += ["--stream-interval", str(stream_interval)]
            with child(args, control):
                started = time.perf_counter()
                asyncio.run(_DRIVERS[api](control, num_seqs, steps, seed))
                wall = time.perf_counter() - started
        finally:
            stop_process(harness)
        gaps = json.loads(record.read_text())
    steady = sorted(g for n, g in gaps if n == num_seqs)
    assert steady, f"no step ran with {num_seqs} sequences"
    ms = [g * 1000 for g in steady]
    return {
        "api": api,
        "running_sequences": num_seqs,
        "stream_interval": stream_interval,
        "steps_measured": len(ms),
        "ms_per_step_mean": round(statistics.fmean(ms), 3),
        "ms_per_step_p50": round(ms[len(ms) // 2], 3),
        "ms_per_step_p90": round(ms[int(len(ms) * 0.9)], 3),
        "ms_per_step_p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3),
        "us_per_sequence_per_step": round(statistics.fmean(ms) * 1000 / num_seqs, 1),
        "wall_seconds": round(wall, 2),
    }


def _wire() -> InProcessLink:
    """A link that answers with InstantCompute's logic in this process; the step and its
    result are serialised and parsed as gRPC would."""
    compute = InstantCompute(num_blocks=100_000, block_size=16, vocab_size=49152)
    return InProcessLink(lambda: compute.description, compute.answer, wire=True)


def breakdown(
    num_seqs: int, steps: int, stream_interval: int = 1, api: str = "generate_many"
) -> dict[str, float]:
    """Mean ms per step of each part of the control plane's step loop, in one process."""

    async def run() -> dict[str, float]:
        config = ControlConfig(stream_interval=stream_interval, max_num_seqs=max(256, num_seqs))
        link = _wire()
        engine = ControlEngine(config, load_tokenizer(bundled_gguf()), link)
        # The plane's parts driven by hand (its step loop is not started).
        plane = engine.planes[link.address] = ComputePlane(engine, link)
        await plane._attach()
        sched = plane.scheduler
        assert sched is not None
        params = pb.GenerationParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
        outbox = CallOutbox() if api == "generate_many" else None
        streams = [
            engine.submit([100 + i % 20000] * 16, params, outbox, str(i), packed=True)
            for i in range(num_seqs)
        ]
        parts = dict.fromkeys(("schedule", "build_step", "wire", "update", "outputs"), 0.0)
        clock = time.perf_counter
        for i in range(steps + 4):  # the first steps admit the prompts
            t0 = clock()
            out = sched.schedule()
            t1 = clock()
            plane._step_id += 1
            step = plane._to_step(out)
            t2 = clock()
            await link.send(step)
            result = await link.receive()
            t3 = clock()
            sampled = sampled_tokens(result)
            sched.update(out, sampled)
            t4 = clock()
            plane._emit(result, sampled)
            plane._observe_pool()
            # Outputs end with the serialised messages gRPC would send.
            if outbox is not None:  # what the GenerateMany call's writer takes
                if not outbox.empty:
                    for message in (await outbox.take())[0]:
                        message.SerializeToString()
            else:
                for st in streams:  # what the Generate coroutines would take
                    while not st.queue.empty():
                        resp = st.queue.get_nowait()
                        assert isinstance(resp, pb.GenerateResponse)
                        resp.SerializeToString()
            t5 = clock()
            if i >= 4:
                assert len(sched.running) == num_seqs
                for key, dt in zip(
                    parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
                ):
                    parts[key] += dt
        # "wire" is the serialisation both ways plus the harness's own answer.
        ms = {f"{k}_ms": round(v * 1000 / steps, 3) for k, v in parts.items()}
        ms["total_ms"] = round(sum(parts.values()) * 1000 / steps, 3)
        return ms

    return asyncio.run(run())


def _part(api: str, stream_interval: int, num_seqs: int) -> str:
    return f"{api}/stream_interval={stream_interval}/seqs={num_seqs}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqs", default="1,64,256", help="running sequences to measure at")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per measurement")
    ap.add_argument(
        "--stream-intervals", default="1,16", help="control plane --stream-interval values"
    )
    ap.add_argument(
        "--apis",
        default="generate_many,generate",
        help="how the client streams: generate_many (one call for all, as the gateway does) "
        "or generate (a call per request)",
    )
    ap.add_argument("--out", type=Path, default=Path("docs/perf/overhead.json"))
    args = ap.parse_args(argv)
    try:
        intervals = [int(x) for x in args.stream_intervals.split(",")]
        counts = [int(x) for x in args.seqs.split(",")]
    except ValueError as e:
        ap.error(f"--seqs / --stream-intervals: {e}")
    apis = args.apis.split(",")
    if bad := [a for a in apis if a not in _DRIVERS]:
        ap.error(f"--apis: unknown {', '.join(bad)} (choose from {', '.join(_DRIVERS)})")
    plan = [(api, i, n) for api in apis for i in intervals for n in counts]
    report: dict[str, Any] = {"benchmark": "control-plane overhead", "machine": machine()}
    report["results"] = []
    parts = ReportParts(args.out, report, [_part(*p) for p in plan])
    for api, interval, n in plan:
        with parts.part(_part(api, interval, n)):
            r = measure(n, args.steps, interval, api)
            r["in_process"] = breakdown(n, args.steps, interval, api)
            report["results"].append(r)
            print(json.dumps(r))
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
