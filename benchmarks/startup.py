"""Time from nothing to an answering `/ready`, for the three planes on loopback.

`together` starts them as `hetero-infer serve` does (hetero_infer.local.start_planes: the
control plane while the compute plane loads, the gateway once the control plane
listens); `one_by_one` starts each once the one before it serves, as `serve` did before
2026-11-27. The two alternate, `--runs` times each, in one process; the report gives
each run and the median, and the ratio of the medians. Each plane's own start is in
the `one_by_one` runs (compute serving, control serving, gateway ready). Run it alone
on the machine: with 2 cores a second busy process changes the figures.

    python -m benchmarks.startup --runs 5
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.workload import machine, write_report
from hetero_infer.local import (
    child,
    free_port,
    gateway_process,
    start_planes,
    wait_http_ready,
)


def _args(model: str) -> tuple[list[str], str, list[str], str]:
    kport, cport = free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{cport}"
    kargs = ["compute-plane", "--model", model, "--port", str(kport), "--metrics-port", "-1"]
    cargs = ["control-plane", "--model", model, "--port", str(cport), "--compute", compute]
    return kargs, compute, [*cargs, "--metrics-port", "-1"], control


def together(model: str) -> dict[str, float]:
    kargs, compute, cargs, control = _args(model)
    port = free_port()
    front = functools.partial(gateway_process, port=port, quiet=True)
    start = time.perf_counter()
    with start_planes([(kargs, compute)], (cargs, control), quiet=True, front=front) as gw:
        assert isinstance(gw, subprocess.Popen)
        wait_http_ready(f"http://127.0.0.1:{port}/ready", gw)
        return {"ready_s": time.perf_counter() - start}


def one_by_one(model: str) -> dict[str, float]:
    kargs, compute, cargs, control = _args(model)
    port = free_port()
    start = time.perf_counter()
    with child(kargs, compute, quiet=True):
        t_compute = time.perf_counter()
        with child(cargs, control, quiet=True):
            t_control = time.perf_counter()
            with gateway_process(control, port, quiet=True) as gw:
                wait_http_ready(f"http://127.0.0.1:{port}/ready", gw)
                end = time.perf_counter()
    return {
        "ready_s": end - start,
        "compute_s": t_compute - start,
        "control_s": t_control - t_compute,
        "gateway_s": end - t_control,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs of each way, alternating")
    ap.add_argument("--model", default="default", help="HF folder, .gguf, or 'default'")
    ap.add_argument("--out", type=Path, default=Path("docs/perf/startup.json"))
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "startup", "machine": machine(), "model": args.model}
    runs: dict[str, list[dict[str, float]]] = {"together": [], "one_by_one": []}
    for i in range(args.runs):
        for name, way in (("together", together), ("one_by_one", one_by_one)):
            r = {k: round(v, 3) for k, v in way(args.model).items()}
            runs[name].append(r)
            print(json.dumps({"run": i, "way": name, **r}), flush=True)
    median = {
        name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
        for name, rs in runs.items()
    }
    report["runs"] = runs
    report["median"] = median
    report["together_vs_one_by_one"] = round(
        median["together"]["ready_s"] / median["one_by_one"]["ready_s"], 3
    )
    print(json.dumps({"median": median, "ratio": report["together_vs_one_by_one"]}))
    write_report(args.out, report)
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
