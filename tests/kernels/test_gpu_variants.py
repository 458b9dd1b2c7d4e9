"""benchmarks.gpu_variants' plumbing on small shapes (the interpreter on the CPU):
every config it runs is checked against torch's result and timed, the best good one is
reported beside the separate kernels, and decode attention agrees across split counts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from benchmarks import gpu_variants as gv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_linears_check_and_time_each_config() -> None:
    configs = [
        triton.Config({"BLOCK_N": 8, "BLOCK_K": 64, "PRELOAD": True}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "PRELOAD": False}, num_warps=4, num_stages=2),
    ]
    report = gv.linears(gv.SHAPES["tiny"], 2, gv.clock_us, torch.float32, DEVICE, configs)
    assert set(report) == {"qkv", "o", "down"}
    for name, row in report.items():
        assert [e["config"]["BLOCK_N"] for e in row["configs"]] == [8, 16], name
        assert all(e["ok"] and e["us"] > 0 for e in row["configs"]), row["configs"]
        assert row["best"] in row["configs"] and row["separate_us"] > 0
    assert report["down"]["K"] == 64 and report["down"]["op"] == "silu"


def _once(fn: Callable[[], object], per_call: int) -> float:
    """A timer that runs `fn` once (the interpreter's times say nothing)."""
    fn()
    return 1.0


def test_attention_by_split_count_agrees() -> None:
    rows = gv.attention((40,), 1, _once, torch.float32, DEVICE, graph_splits=3)
    assert [r["splits"] for r in rows] == [1, 2, 3, 4, 8, 16]
    assert all(r["max_abs_diff"] < 1e-4 for r in rows), rows
    assert all("combine_us" in r for r in rows if r["splits"] > 1)
