"""Where a decode step's time goes, across the gRPC hop: a step timeline.

    python -m benchmarks.profile                    # CPU, bundled model, 32 sequences
    python -m benchmarks.profile --concurrency 8 --compute-arg=--device=cuda
    python -m benchmarks.profile --concurrency 1 --async-scheduling --out docs/perf/profile_async_1.json
    python -m benchmarks.profile --concurrency 1 --async-scheduling --steps-ahead 2

The compute plane runs as its own process (over gRPC, as deployed); the control plane's
engine runs in this process so that its step loop can be timed. `--concurrency`
requests (random 64-token prompts, `--output-len` tokens each, EOS ignored, greedy) run
together; once they all decode, every step is split into:

- control plane: schedule, encode (the StepRequest), gRPC send (to the compute plane
  having the step), output processing of the previous step (overlapped with the step),
  gRPC return (from the compute plane handing the result to gRPC to the result here:
  serialisation, transport, parsing), update (progress, stop checks, grammar masks);
- compute plane: input build, forward, sample, other (validation, the result message);
- the compute plane's idle gap: from handing step k's result to gRPC to having step k+1
  (negative where step k+1 came while k ran: overlapped steps, on CUDA by default);
- on CUDA, the device's idle gap (`device_idle`): from the end of step k's sampling to the
  start of step k+1's forward, by events on its stream (StepResult.device_idle_ns): the
  samples' copy out, the inputs' copy in, and any wait for the host to launch the step.

Writes a table (mean and p50 per phase, ms) to stdout and `docs/perf/profile.json` (with
each decode step's marks, `steps`, µs from the first), and a timeline of a few steps to
`docs/perf/profile_timeline.png`. Timestamps are wall-clock
(`time.time_ns`) on both processes of one machine. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
from pathlib import Path
from typing import Any

from benchmarks.workload import Preset, machine, make_workload, write_report
from hetero_common.model_path import ModelNotFoundError, resolve_model_path

PHASES = [
    # (name, plane, start mark, end mark) over one step's record; "next_received" is the
    # compute plane having the next step.
    ("schedule", "control", "schedule_start", "scheduled"),
    ("encode", "control", "scheduled", "encoded"),
    ("grpc_send", "hop", "encoded", "compute_received"),
    ("output_processing", "control", "sent", "emitted"),
    ("grpc_return", "hop", "compute_replied", "result"),
    ("update", "control", "result", "updated"),
    ("compute_idle", "compute", "compute_replied", "next_received"),
]


async def _run(
    model: str,
    concurrency: int,
    output_len: int,
    compute_args: list[str],
    async_scheduling: bool | None = None,
    steps_ahead: int | None = None,
) -> tuple[list[dict[str, int]], dict[str, Any]]:
    """The timeline of the timed round, and the scheduling the control plane applied (the
    flags as resolved at attach: unset, async scheduling is on only for a GPU)."""
    from control_plane.config import ControlConfig
    from control_plane.engine import ControlEngine
    from control_plane.tokenizer import load_tokenizer
    from hetero_infer.local import child, free_port
    from hetero_proto import control_pb2 as pb

    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ["--log-level", "WARNING", "compute-plane", "--model", model, "--port", str(port)]
    with child([*args, "--metrics-port", "-1", *compute_args], address):
        engine = ControlEngine(
            ControlConfig(
                compute=address,
                model=model,
                async_scheduling=async_scheduling,
                steps_ahead=steps_ahead,
            ),
            load_tokenizer(Path(model)),
        )
        await engine.start()
        await asyncio.wait_for(engine.attached.wait(), 120)
        plane = engine.plane
        assert plane is not None  # (attached)
        applied = {"async_scheduling": plane.async_scheduling, "steps_ahead": plane.steps_ahead}

        async def batch(seed: int) -> None:
            work = make_workload(Preset(concurrency, (64, 64), (output_len, output_len)), seed)
            params = pb.GenerationParams(max_tokens=output_len, ignore_eos=True)
            streams = [engine.submit(r.prompt, params) for r in work]
            for s in streams:
                while True:
                    msg = await s.queue.get()
                    if isinstance(msg, BaseException):
                        raise msg
                    if msg.HasField("usage"):
                        break

        await batch(1)  # warm-up
        engine.timeline = []
        await batch(2)
        timeline = engine.timeline
        await engine.stop()
    return timeline, applied


def analyse(timeline: list[dict[str, int]], concurrency: int) -> dict[str, Any]:
    """Per-phase figures over the steps where every sequence decodes."""
    for a, b in itertools.pairwise(timeline):
        a["next_received"] = b["compute_received"]
    steps = [
        t
        for t in timeline
        if "next_received" in t and t["num_seqs"] == concurrency and t["num_tokens"] == concurrency
    ]
    if not steps:
        raise SystemExit("no decode step ran all sequences together")
    out: dict[str, Any] = {"decode_steps": len(steps)}

    def ms(values: list[float]) -> dict[str, float]:
        return {
            "mean": round(statistics.fmean(values), 3),
            "p50": round(statistics.median(values), 3),
        }

    for name, _, start, end in PHASES:
        out[name] = ms([(t[end] - t[start]) / 1e6 for t in steps])
    for name in ("prepare_ns", "forward_ns", "sample_ns"):
        out[name.removesuffix("_ns")] = ms([t[name] / 1e6 for t in steps])
    out["compute_other"] = ms(
        [
            (
                t["compute_replied"]
                - t["compute_received"]
                - t["prepare_ns"]
                - t["forward_ns"]
                - t["sample_ns"]
            )
            / 1e6
            for t in steps
        ]
    )
    out["step"] = ms([(t["next_received"] - t["compute_received"]) / 1e6 for t in steps])
    out["compute_busy"] = ms([(t["compute_replied"] - t["compute_received"]) / 1e6 for t in steps])
    idle = out["compute_idle"]["mean"] / out["step"]["mean"]
    out["compute_idle_fraction"] = round(idle, 3)
    if device := [t["device_idle_ns"] / 1e6 for t in steps if "device_idle_ns" in t]:
        out["device_idle"] = ms(device)
        out["device_idle_fraction"] = round(out["device_idle"]["mean"] / out["step"]["mean"], 3)
    return out


def raw_steps(timeline: list[dict[str, int]], concurrency: int) -> list[dict[str, float]]:
    """The decode steps' own records, in µs: marks from the first one's schedule start,
    durations as measured (what `analyse` averages, kept so that a report of a lent
    machine answers later questions about single steps)."""
    steps = [t for t in timeline if t["num_seqs"] == concurrency == t["num_tokens"]]
    if not steps:
        return []
    origin = steps[0]["schedule_start"]
    durations = ("prepare_ns", "forward_ns", "sample_ns", "device_idle_ns")
    out = []
    for t in steps:
        row: dict[str, float] = {"step_id": t["step_id"]}
        for key, value in t.items():
            if key in durations:
                row[key.removesuffix("_ns") + "_us"] = round(value / 1e3, 1)
            elif key not in ("step_id", "num_seqs", "num_tokens"):
                row[key] = round((value - origin) / 1e3, 1)
        out.append(row)
    return out


def plot(timeline: list[dict[str, int]], concurrency: int, path: Path, count: int = 6) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [
        t for t in timeline if t["num_seqs"] == concurrency and t["num_tokens"] == concurrency
    ][5 : 5 + count]
    if not steps:
        return
    t0 = steps[0]["schedule_start"]
    fig, ax = plt.subplots(figsize=(10, 3))
    colors = {
        "schedule": "tab:blue",
        "encode": "tab:cyan",
        "grpc_send": "tab:gray",
        "output_processing": "tab:purple",
        "grpc_return": "tab:olive",
        "update": "tab:pink",
        "input build": "tab:orange",
        "forward": "tab:red",
        "sample": "tab:brown",
    }
    rows = {"control": 2, "hop": 1, "compute": 0}
    seen: set[str] = set()

    def bar(row: str, name: str, start: int, end: int) -> None:
        label = None if name in seen else name
        seen.add(name)
        ax.broken_barh(
            [((start - t0) / 1e6, (end - start) / 1e6)],
            (rows[row] - 0.4, 0.8),
            color=colors[name],
            label=label,
        )

    done = 0  # the last step's end: an overlapped step starts after it
    for t in steps:
        for name, plane, start, end in PHASES:
            if plane != "compute":
                bar(plane, name, t[start], t[end])
        at = max(t["compute_received"], done)
        for name, key in (
            ("input build", "prepare_ns"),
            ("forward", "forward_ns"),
            ("sample", "sample_ns"),
        ):
            bar("compute", name, at, at + t[key])
            at += t[key]
        done = at
    ax.set_yticks([0, 1, 2], ["compute plane", "gRPC hop", "control plane"])
    ax.set_xlabel("ms")
    ax.set_title(f"{count} decode steps of {concurrency} sequences (white: idle)")
    ax.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="default",
        help="HF folder, .gguf, or a name ('default': the bundled GGUF)",
    )
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--compute-arg", action="append", default=[], help="extra compute-plane flag")
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the control plane plans steps ahead (default: its own, on for a GPU)",
    )
    ap.add_argument(
        "--steps-ahead",
        type=int,
        default=None,
        help="with async scheduling, steps planned beyond the one awaited (default: the "
        "control plane's own, 2 for a GPU)",
    )
    ap.add_argument("--out", type=Path, default=Path("docs/perf/profile.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/perf/profile_timeline.png"))
    args = ap.parse_args(argv)
    try:  # (a name, as the planes take it: the engine here reads the tokenizer's files)
        model = str(resolve_model_path(args.model))
    except ModelNotFoundError as e:
        ap.error(f"--model: {e}")
    timeline, applied = asyncio.run(
        _run(
            model,
            args.concurrency,
            args.output_len,
            args.compute_arg,
            args.async_scheduling,
            args.steps_ahead,
        )
    )
    result = analyse(timeline, args.concurrency)
    report = {
        "machine": machine(),
        "model": Path(model).name,
        "concurrency": args.concurrency,
        "compute_args": args.compute_arg,
        **applied,  # (as applied: the flags left unset are the control plane's defaults)
        "ms": result,
        "steps": raw_steps(timeline, args.concurrency),
    }
    write_report(args.out, report)
    print(f"{result['decode_steps']} decode steps of {args.concurrency} sequences (ms: mean / p50)")
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"  {key:18s} {value['mean']:8.3f} {value['p50']:8.3f}")
    print(f"  compute plane idle: {100 * result['compute_idle_fraction']:.1f}% of the step")
    if "device_idle_fraction" in result:
        print(
            f"  device idle (CUDA events): {100 * result['device_idle_fraction']:.1f}% of the step"
        )
    try:
        plot(timeline, args.concurrency, args.plot)
        print(f"timeline: {args.plot}")
    except ModuleNotFoundError:
        print("matplotlib not installed: no timeline plot")
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
