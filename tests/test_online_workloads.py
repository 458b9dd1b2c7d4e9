"""The online benchmark's workloads, arrival processes and summary (benchmarks/online.py).

Expected values come from the definitions in the issue (75% long prompts, a shared
~1k-token prefix, Poisson gaps of mean 1/rate) and from hand-computed samples, not from
the benchmark's own output.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks import online
from benchmarks.workload import PRESETS, make_workload


def test_chunked_prefill_workload_is_three_quarters_long_prompts() -> None:
    work = online.build_workload("chunked-prefill", 800, "default", seed=3)
    long = [r for r in work if len(r.prompt) >= 1024]
    assert all(1024 <= len(r.prompt) <= 1536 for r in long)
    assert all(32 <= len(r.prompt) <= 128 for r in work if r not in long)
    assert 0.70 <= len(long) / len(work) <= 0.80  # 0.75 +- ~4 standard deviations


def test_prefix_workload_shares_a_1k_token_prefix() -> None:
    work = online.build_workload("prefix", 12, "default", seed=5)
    prefix = work[0].prompt[:1024]
    assert all(r.prompt[:1024] == prefix for r in work)
    assert all(16 <= len(r.prompt) - 1024 <= 48 for r in work)
    assert len({tuple(r.prompt[1024:]) for r in work}) == len(work)  # distinct suffixes


@pytest.mark.parametrize("kind", ["sequential", "burst"])
def test_all_at_once_arrivals_have_no_gaps(kind: str) -> None:
    assert list(online.arrival_gaps(kind, 5, rate=3.0, seed=0)) == [0.0] * 5


def test_fixed_and_poisson_arrivals_keep_the_rate() -> None:
    assert list(online.arrival_gaps("fixed", 4, rate=4.0, seed=0)) == [0.25] * 4
    gaps = list(online.arrival_gaps("poisson", 4000, rate=4.0, seed=0))
    assert abs(statistics.fmean(gaps) - 0.25) < 0.02  # mean 1/rate
    assert abs(statistics.pstdev(gaps) - 0.25) < 0.02  # exponential: sd equals the mean
    assert len(set(gaps)) == len(gaps)


def test_summary_latencies_and_goodput_from_hand_made_samples() -> None:
    # Two requests done, one failed. Times in seconds.
    a = online.Sample(sent=0.0, first=0.5, done=2.5, chunk_times=[0.5, 1.0, 2.5], tokens=5)
    b = online.Sample(sent=1.0, first=4.0, done=4.4, chunk_times=[4.0, 4.4], tokens=3)
    c = online.Sample(sent=2.0, error="HTTP 503")
    work = [online.Request([1] * 10, 5), online.Request([1] * 20, 3), online.Request([1] * 7, 4)]
    kv = online.KvSamples(waste=[0.02, 0.04])
    s = online.summarize([a, b, c], work, duration=5.0, kv=kv, slo=(2000.0, 600.0))
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, ["HTTP 503"])
    assert s["ttft_ms"]["mean"] == 1750.0  # (500 + 3000) / 2
    assert s["tpot_ms"]["mean"] == 350.0  # (2000 / 4 + 400 / 2) / 2
    assert s["itl_ms"]["mean"] == pytest.approx((500 + 1500 + 400) / 3, abs=0.01)
    assert s["e2e_ms"]["p50"] == 3400.0  # of 2500 and 3400 the upper one at p50
    assert s["output_token_throughput"] == 1.6  # 8 tokens in 5 s
    assert s["total_token_throughput"] == 7.6  # + 30 prompt tokens of the completed two
    assert s["goodput"] == 0.2  # only a meets TTFT <= 2 s and TPOT <= 600 ms
    assert s["kv_waste"] == {"mean": 0.03, "max": 0.04, "samples": 2}
    assert s["kv_waste_error"] is None


@pytest.mark.slow
def test_rate_sweep_and_prefix_comparison_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (matplotlib)")
    out = tmp_path / "rates.json"
    args = ["--launch", "--preset", "tiny", "--rates", "4,8", "--num-requests", "3"]
    report = online.main([*args, "--out", str(out), "--no-progress"])
    assert [(r["sweep"], r["rate"]) for r in report["runs"]] == [("rate", 4.0), ("rate", 8.0)]
    assert all(r["completed"] == 3 and not r["errors"] for r in report["runs"])
    assert [Path(p).name for p in report["plots"]] == ["online_latency_vs_rate.png"]
    assert (tmp_path / "online_latency_vs_rate.png").stat().st_size > 1000

    args = ["--launch", "--workload", "prefix", "--compare-prefix-caching"]
    args += ["--arrival", "sequential", "--num-requests", "3"]
    report = online.main([*args, "--out", str(tmp_path / "prefix.json"), "--no-progress"])
    assert [r["prefix_caching"] for r in report["runs"]] == [True, False]
    assert all(r["completed"] == 3 for r in report["runs"])
    assert report["ttft_p50_ratio_off_vs_on"] > 1  # the cached prefix is not recomputed


@pytest.mark.parametrize(
    ("preset", "count", "prompts", "outputs"),
    [("default", 64, (32, 512), (32, 256)), ("gpu", 256, (100, 1024), (100, 1024))],
)
def test_offline_presets_are_the_issues_workloads(preset, count, prompts, outputs) -> None:  # type: ignore[no-untyped-def]
    work = make_workload(PRESETS[preset], seed=0)
    assert len(work) == count
    assert all(prompts[0] <= len(r.prompt) <= prompts[1] for r in work)
    assert all(outputs[0] <= r.output_len <= outputs[1] for r in work)
    assert work == make_workload(PRESETS[preset], seed=0)  # seeded: the same every run
    assert work != make_workload(PRESETS[preset], seed=1)
