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
"""

from __future__ import annotations

import argparse
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
    tables = {f"r{i}": list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(seqs)}
    first = pb.StepRequest(step_id=0)
    for i, (rid, blocks) in enumerate(tables.items()):
        first.new_requests.add(
            request_id=rid,
            token_ids=[3 + (i * 7 + j) % 500 for j in range(prompt)],
            num_prompt_tokens=prompt,
            num_scheduled_tokens=prompt,
            block_ids=blocks,  # every block up front: decode steps are decode_ids only
            sampling=pb.SamplingParams(temperature=0.0),
        )
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


def _run(tree: Path, model: Path, seqs: int, steps: int) -> dict[str, float]:
    """`measure` in a subprocess whose planes are `tree`'s (its working directory)."""
    code = (
        "import json, runpy, sys; from pathlib import Path; "
        "m = runpy.run_path(sys.argv[1], run_name='compute_host')['measure']; "
        "print(json.dumps(m(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code, __file__, str(model), str(seqs), str(steps)],
        env=env, cwd=tree, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.gpu import write_random_model
    from benchmarks.workload import machine, write_report

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3, help="alternated runs of each tree")
    ap.add_argument("--compare-ref", default=None, help="git revision measured beside this tree")
    ap.add_argument("--out", type=Path, default=Path("docs/perf/compute_host.json"))
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix="compute-host-"))
    model = write_random_model(work / "model", TINY, device="cpu")
    trees = {"this": root}
    if args.compare_ref:
        ref = work / "ref"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(ref), args.compare_ref],
            check=True, capture_output=True,
        )  # fmt: skip
        trees = {args.compare_ref: ref, "this": root}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for i in range(args.runs):
            for name, tree in trees.items():
                fig = _run(tree, model, args.seqs, args.steps)
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
        "model": {k: TINY[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
        "ms_per_step_median": medians,
        "runs": runs,
    }
    if args.compare_ref:
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
