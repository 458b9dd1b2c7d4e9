"""Data-parallel scaling: the same workload on 1 and on 2 compute planes behind one
control plane, one after the other in one run.

    python -m benchmarks.scale               # writes docs/perf/scale.json

Each compute plane is its own process limited to one torch thread (--num-threads 1), so
two planes use two cores where one uses one; the control plane is one process driving
them, and this process calls its gRPC `Generate` for every request at once (token-id
prompts, greedy, EOS ignored: every request produces exactly its output length). Reports
output tokens/s of each and its ratio to the first. Run it alone on the machine: a
second busy process changes the figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.offline import run_grpc
from benchmarks.workload import Preset, machine, make_workload, preset_dict, write_report
from hetero_common.cpus import usable_cpus

# Long enough that start-up and the last stragglers weigh little; short prompts so the
# figure is mostly decode, where a plane's step is bound by its one core.
WORKLOAD = Preset(128, (32, 128), (96, 160))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planes", default="1,2", help="compute plane counts, run in this order")
    ap.add_argument("--requests", type=int, default=WORKLOAD.num_requests)
    ap.add_argument("--out", type=Path, default=Path("docs/perf/scale.json"))
    args = ap.parse_args(argv)
    cpus = usable_cpus()
    try:
        planes = [int(x) for x in args.planes.split(",")]
    except ValueError:
        ap.error(f"--planes must be comma-separated counts, got {args.planes!r}")
    if not all(1 <= n <= cpus for n in planes):  # (before a run: not after the first)
        ap.error(f"--planes: each count must be in 1..{cpus} (a CPU each), got {args.planes}")
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    preset = Preset(args.requests, WORKLOAD.prompt_len, WORKLOAD.output_len)
    work = make_workload(preset, args.seed)
    report: dict[str, Any] = {
        "benchmark": "scale",
        "workload": preset_dict(preset) | {"seed": args.seed},
        "compute_plane_threads": 1,
        "machine": machine(),
        "runs": [],
    }
    for n in planes:
        run = run_grpc(args.model, work, compute_args=("--num-threads", "1"), num_compute=n)
        run["compute_planes"] = n
        report["runs"].append(run)
        print(f"{n} compute plane(s): {run['output_tokens_per_s']:.1f} output tok/s", flush=True)
    base = report["runs"][0]["output_tokens_per_s"]
    for run in report["runs"]:
        run["ratio_to_first"] = round(run["output_tokens_per_s"] / base, 3)
    for run in report["runs"][1:]:
        print(
            f"{run['compute_planes']} planes / {report['runs'][0]['compute_planes']}: "
            f"{run['ratio_to_first']:.2f}x"
        )
    write_report(args.out, report)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
