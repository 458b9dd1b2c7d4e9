"""The compute plane's host work per decode step: what a GPU waits for between steps.

    python -m benchmarks.compute_host                        # writes docs/perf/compute_host.json
    python -m benchmarks.compute_host --compare-ref 17b2088  # and a git revision beside it

An engine on the CPU with a tiny random model (one layer, hidden 64: the forward is
small, so what is measured is the Python around it) holds N sequences (default 256, the
GPU benchmark's batch) and runs decode steps as the gRPC server would: parse the
StepRequest, `Engine.step`, serialise the StepResult. Per step, from the result's own
timings: input build (`prepare_ns`), forward, sample (LM head + sampling), and the rest
(parse, validation, taking the samples, the result message). On a GPU the forward runs
on the device and the rest of this is host time the device waits for, unless it is
hidden. `--compare-ref` runs the same measurement on a git revision's planes (a worktree,
in a subprocess), alternated with this tree's, medians over the runs. Run it alone.

    python -m benchmarks.compute_host --grpc --seqs 32   # through the gRPC server

`--grpc` measures the served path instead: the compute plane in its own process (the
real server, `--compute-arg` passed to it), driven over its `Run` stream from this one
with 1 + `--ahead` steps in flight (as a control plane planning ahead sends them). Per decode
step: the wall time between results (`period`) and the server's CPU time, split into its
event loop's thread (gRPC, the step loop) and its other threads (the engine's worker,
the samples' waiter, gRPC's poller), from the kernel's per-thread accounting. The CPU
time is what a GPU waits for once it exceeds the device's step; on these 2 cores it
varies less between runs than the wall time does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
BLOCK = 16


def _requests(seqs: int, prompt: int, per_seq: int) -> tuple[dict[str, list[int]], Any]:
    """(each request's block table, the first step: every request's prompt, greedy), each
    request with `per_seq` blocks up front, so that its decode steps are decode_ids only."""
    from hetero_proto import compute_pb2 as pb

    tables = {f"r{i}": list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(seqs)}
    first = pb.StepRequest(step_id=0)
    for i, (rid, blocks) in enumerate(tables.items()):
        first.new_requests.add(
            request_id=rid,
            token_ids=[3 + (i * 7 + j) % 500 for j in range(prompt)],
            num_prompt_tokens=prompt,
            num_scheduled_tokens=prompt,
            block_ids=blocks,
            sampling=pb.SamplingParams(temperature=0.0),
        )
    return tables, first


def measure(model: Path, seqs: int, steps: int, prompt: int = 100) -> dict[str, float]:
    """Mean ms per decode step of each part, `seqs` sequences decoding (this process's
    compute_plane: the tree on sys.path)."""
    import torch

    from compute_plane.config import ComputeConfig
    from compute_plane.engine import Engine
    from compute_plane.loader import load_model
    from hetero_proto import compute_pb2 as pb

    torch.set_num_threads(1)
    cfg = ComputeConfig(
        model=str(model),
        block_size=BLOCK,
        kv_cache_bytes=256 << 20,
        max_num_seqs=seqs,
        max_num_batched_tokens=seqs * prompt,
    )
    engine = Engine(cfg, load_model(model, progress=False))
    per_seq = -(-(prompt + steps + 20) // BLOCK)
    assert seqs * per_seq < engine.num_blocks, "KV pool too small"
    tables, first = _requests(seqs, prompt, per_seq)
    engine.step(first)
    wire = [
        pb.StepRequest(step_id=k, decode_ids=list(tables)).SerializeToString()
        for k in range(1, steps + 1)
    ]
    parts = {"prepare": 0.0, "forward": 0.0, "sample": 0.0, "rest": 0.0, "step": 0.0}
    warm = 10
    for k, message in enumerate(wire):
        t0 = time.perf_counter_ns()
        result = engine.step(pb.StepRequest.FromString(message))
        result.SerializeToString()
        total = time.perf_counter_ns() - t0
        if k < warm:
            continue
        own = result.prepare_ns + result.forward_ns + result.sample_ns
        parts["prepare"] += result.prepare_ns
        parts["forward"] += result.forward_ns
        parts["sample"] += result.sample_ns
        parts["rest"] += total - own
        parts["step"] += total
    n = len(wire) - warm
    out = {k: round(v / n / 1e6, 4) for k, v in parts.items()}
    out["host"] = round(out["step"] - out["forward"], 4)
    # The same forward in every tree: host work over it is steadier than ms when the
    # machine's speed drifts between runs (it does on these 2 cores).
    out["host_per_forward"] = round(out["host"] / out["forward"], 4)
    return out


def _cpu_ns(pid: int) -> dict[int, int]:
    """Each thread's time on a CPU so far (ns), by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # (a thread ended)
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return out


def measure_grpc(
    model: Path, seqs: int, steps: int, in_flight: int, compute_args: list[str], prompt: int = 100
) -> dict[str, float]:
    """Mean ms per decode step through a compute-plane server process (the planes on
    this process's path: `_run` runs it in the tree measured)."""
    import asyncio

    import grpc

    from hetero_infer.local import child, free_port
    from hetero_proto import compute_pb2 as pb
    from hetero_proto import compute_pb2_grpc as pb_grpc

    warm = 20
    per_seq = -(-(prompt + warm + steps + 20) // BLOCK)
    tables, first = _requests(seqs, prompt, per_seq)
    decodes = [
        pb.StepRequest(step_id=k, decode_ids=list(tables)) for k in range(1, warm + steps + 1)
    ]
    port = free_port()
    address = f"127.0.0.1:{port}"
    layers, kv_heads, head_dim = (
        int(str(TINY[k])) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
    )
    kv = (seqs * per_seq + 8) * BLOCK * layers * kv_heads * head_dim * 2 * 4  # K and V, fp32
    args = ["--log-level", "WARNING", "compute-plane", "--model", str(model), "--port", str(port)]
    args += ["--metrics-port", "-1", "--block-size", str(BLOCK), "--max-num-seqs", str(seqs)]
    args += ["--max-num-batched-tokens", str(seqs * prompt), "--kv-cache-bytes", str(kv)]
    args += ["--num-threads", "1"]  # (as `measure`: one CPU for the forward's kernels)

    async def drive(pid: int) -> dict[str, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.ComputePlaneStub(channel).Run()
            await call.write(first)
            assert not (await call.read()).HasField("error")
            todo = iter(decodes)
            for _ in range(in_flight):
                await call.write(next(todo))
            cpu: dict[int, int] = {}
            t0 = c0 = 0
            parts = {"prepare": 0, "forward": 0, "sample": 0}
            for k in range(len(decodes)):
                if k == warm:
                    cpu, t0, c0 = _cpu_ns(pid), time.perf_counter_ns(), time.process_time_ns()
                result = await call.read()
                assert len(result.sampled_ids) == seqs, result
                if k >= warm:
                    parts["prepare"] += result.prepare_ns
                    parts["forward"] += result.forward_ns
                    parts["sample"] += result.sample_ns
                if (step := next(todo, None)) is not None:
                    await call.write(step)
            wall, client = time.perf_counter_ns() - t0, time.process_time_ns() - c0
            after = _cpu_ns(pid)
            await call.done_writing()
        used = {tid: after[tid] - cpu.get(tid, 0) for tid in after}
        loop = used.pop(pid, 0)
        out = {"period": wall, "server_cpu": loop + sum(used.values()), "loop_thread": loop}
        out |= {"other_threads": sum(used.values()), "client_cpu": client, **parts}
        return {k: round(v / steps / 1e6, 4) for k, v in out.items()}

    with child([*args, *compute_args], address) as proc:
        return asyncio.run(drive(proc.pid))


def _run(tree: Path, model: Path, how: dict[str, Any]) -> dict[str, float]:
    """`measure` (or `measure_grpc`, with `how["grpc"]`) in a subprocess whose planes are
    `tree`'s (its working directory)."""
    code = (
        "import json, runpy, sys; from pathlib import Path; "
        "m = runpy.run_path(sys.argv[1], run_name='compute_host'); "
        "how = json.loads(sys.argv[3]); grpc = how.pop('grpc'); "
        "f = m['measure_grpc'] if grpc else m['measure']; "
        "print(json.dumps(f(Path(sys.argv[2]), **how)))"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code, __file__, str(model), json.dumps(how)],
        env=env, cwd=tree, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.gpu import write_random_model
    from benchmarks.workload import machine, unknown_revision, write_report

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3, help="alternated runs of each tree")
    ap.add_argument("--compare-ref", default=None, help="git revision measured beside this tree")
    ap.add_argument("--grpc", action="store_true", help="through the compute plane's server")
    ap.add_argument("--ahead", type=int, default=2, help="--grpc: steps in flight (1 + ahead)")
    ap.add_argument(
        "--compute-arg", action="append", default=[], help="--grpc: a compute-plane argument"
    )
    ap.add_argument(
        "--compare-arg",
        action="append",
        default=[],
        help="--grpc: this tree again with these compute-plane arguments too, alternated",
    )
    ap.add_argument("--out", type=Path, default=None, help="default docs/perf/compute_host.json")
    args = ap.parse_args(argv)
    if args.compare_arg and (not args.grpc or args.compare_ref):
        ap.error("--compare-arg needs --grpc, and no --compare-ref")
    if args.compare_ref and (why := unknown_revision(args.compare_ref)):
        ap.error(f"--compare-ref: {why}")
    if args.out is None:
        name = "compute_host_grpc.json" if args.grpc else "compute_host.json"
        args.out = Path("docs/perf") / name
    how: dict[str, Any] = {"grpc": args.grpc, "seqs": args.seqs, "steps": args.steps}
    if args.grpc:
        how |= {"in_flight": 1 + args.ahead, "compute_args": args.compute_arg}
    root = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix="compute-host-"))
    model = write_random_model(work / "model", TINY, device="cpu")
    trees = {"this": root}
    hows = {"this": how}
    if args.compare_arg:
        alt = "this " + " ".join(args.compare_arg)
        trees[alt] = root
        hows[alt] = how | {"compute_args": [*args.compute_arg, *args.compare_arg]}
    if args.compare_ref:
        ref = work / "ref"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(ref), args.compare_ref],
            check=True, capture_output=True,
        )  # fmt: skip
        trees = {args.compare_ref: ref, "this": root}
        hows[args.compare_ref] = how
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for i in range(args.runs):
            for name, tree in trees.items():
                fig = _run(tree, model, dict(hows[name]))
                runs[name].append(fig)
                print(f"run {i + 1} {name}: {json.dumps(fig)}", flush=True)
    finally:
        if args.compare_ref:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(work / "ref")],
                check=False, capture_output=True,
            )  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
    medians = {
        name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
        for name, rs in runs.items()
    }
    report: dict[str, Any] = {
        "benchmark": "compute_host",
        "machine": machine(),
        "seqs": args.seqs,
        "steps": args.steps,
        **({"grpc": {k: how[k] for k in ("in_flight", "compute_args")}} if args.grpc else {}),
        "model": {k: TINY[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
        "ms_per_step_median": medians,
        "runs": runs,
    }
    if args.grpc and (args.compare_ref or args.compare_arg):
        other = args.compare_ref or alt
        this, them = medians["this"], medians[other]
        # (> 1: the other one costs more per step than this tree as run)
        report["other_over_this"] = {
            "other": other,
            **{k: round(them[k] / this[k], 2) for k in ("server_cpu", "period")},
        }
        print(
            f"server CPU per step: {this['server_cpu']:.3f} ms this, {them['server_cpu']:.3f} "
            f"ms {other}; period {this['period']:.3f} vs {them['period']:.3f} ms"
        )
    elif args.compare_ref:
        before, after = medians[args.compare_ref], medians["this"]
        report["host_ratio"] = round(before["host"] / after["host"], 2)
        report["host_per_forward_ratio"] = round(
            before["host_per_forward"] / after["host_per_forward"], 2
        )
        print(
            f"host work per step: {before['host']:.3f} ms at {args.compare_ref}, "
            f"{after['host']:.3f} ms here ({report['host_ratio']}x); per ms of forward "
            f"{before['host_per_forward']:.3f} vs {after['host_per_forward']:.3f} "
            f"({report['host_per_forward_ratio']}x)"
        )
    write_report(args.out, report)
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
