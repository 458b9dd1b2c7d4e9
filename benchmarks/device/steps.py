"""Run THERE (check.sh's `steps` stage): the decode graph's step at batch 1, 64 and 256 of
the tree whose packages come first on PYTHONPATH (this tree, or an older commit's copy for
a baseline in the same call), with the engine's start-up choice of the small-step linears.

    python3 benchmarks/device/steps.py --label head --out $OUT/steps_head.json

Each way of launching that the tree has is timed in the same process (`step_times` with
both launches: dependent launches on and off, preloading linears or not).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import benchmarks.gpu as gpu
    from hetero_infer.offline import OfflineLLM

    root = Path(gpu.__file__).resolve().parents[1]
    rev = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    peak = gpu.copy_bandwidth()
    llm = OfflineLLM(str(gpu.write_random_model(Path("/tmp/qwen3-0.6b-random"))))
    engine = llm.engine
    report: dict[str, Any] = {
        "label": args.label,
        "tree": str(root),
        "rev": rev or None,
        "copy_bandwidth_GB_per_s": round(peak / 1e9, 1),
        "fused_rows": engine.model.fused_rows,
        "fused_linear_timings": engine.fused_linear_timings,
    }
    print(json.dumps(report), flush=True)
    report["decode_step"] = gpu.step_times(engine, peak, both_launches=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
