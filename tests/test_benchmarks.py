"""The benchmarks run end to end on a tiny workload, so they cannot rot unseen.

These check structure and accounting (every request produced the tokens it asked for),
not speed: speed is what the benchmarks themselves report (docs/performance.md).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import (
    compute_host,
    decode_step,
    offline,
    online,
    overhead,
    peers,
    profile,
    quant_kernel,
    startup,
)
from benchmarks.workload import PRESETS, Preset, make_workload
from hetero_common.model_path import bundled_gguf

pytestmark = pytest.mark.slow


def test_offline_ours_vs_hf_tiny(tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    report = offline.main(
        ["--preset", "tiny", "--hf-batch-size", "2", "--skip-gateway", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    ours, hf = report["runs"]
    tiny = PRESETS["tiny"]
    assert ours["useful_output_tokens"] == hf["useful_output_tokens"]
    assert hf["generated_tokens_incl_padding"] >= hf["useful_output_tokens"]
    assert tiny.output_len[0] * tiny.num_requests <= ours["useful_output_tokens"]
    assert report["ours_vs_hf"] > 0


@pytest.mark.parametrize("control_args", [(), ("--async-scheduling",)], ids=["sync", "async"])
def test_grpc_path_tiny(control_args: tuple[str, ...]) -> None:
    """benchmarks.gpu's gRPC path (compute and control plane processes, Generate calls),
    run here on the CPU with the bundled model: every request gets its tokens."""
    work = make_workload(PRESETS["tiny"], seed=1)
    fig = offline.run_grpc(str(bundled_gguf()), work, control_args=control_args)
    assert fig["useful_output_tokens"] == sum(r.output_len for r in work)
    assert fig["output_tokens_per_s"] > 0
    assert ("async" in fig["system"]) == bool(control_args)


def test_grpc_path_timeout() -> None:
    """A gRPC path whose planes are not serving within its time raises TimeoutError, and
    they are stopped (benchmarks.gpu records it and runs the next path)."""
    import psutil

    work = make_workload(PRESETS["tiny"], seed=1)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(TimeoutError, match="not serving"):
        offline.run_grpc(str(bundled_gguf()), work, timeout=0.5)  # the start-up takes more
    assert {c.pid for c in psutil.Process().children(recursive=True)} == before


def test_gpu_benchmark_parts_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks.gpu's run order on the CPU (its CUDA timings stubbed, a tiny model in
    Qwen3's vocabulary): a part that raises, and a gRPC path whose compute plane cannot
    start, are recorded in `errors` while the other parts still run; a run of one part
    updates the report in place. On a lent GPU one call holds the whole benchmark, so one
    failure must not cost the rest."""
    from benchmarks import gpu

    tiny = gpu.QWEN3_0_6B | {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    }  # fmt: skip
    model = gpu.write_random_model(tmp_path / "model", tiny, device="cpu")

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("no decode graphs here")

    monkeypatch.setattr(gpu, "cuda", lambda: True)
    monkeypatch.setattr(gpu, "machine", lambda: {"cpu": "test"})
    monkeypatch.setattr(gpu, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(gpu, "kernel_bandwidth", lambda peak: [{"batch": 1}])
    monkeypatch.setattr(gpu, "prefill_kernel", lambda: [{"chunks": 1}])
    monkeypatch.setattr(gpu, "free_memory_gb", lambda: 1.0)
    monkeypatch.setattr(gpu, "step_times", broken)
    paths = [("grpc", (), ()), ("grpc_no_overlap", (), ("--no-such-flag",))]
    monkeypatch.setattr(gpu, "GRPC_PATHS", paths)
    out = tmp_path / "gpu.json"
    common = ["--model-dir", str(model), "--preset", "tiny", "--out", str(out)]
    report = gpu.main([*common, "--parts", "kernels,engine,grpc"])
    work = make_workload(PRESETS["tiny"], 0, vocab=(100, 150000))
    useful = sum(r.output_len for r in work)
    assert set(report["errors"]) == {"decode_step", "grpc_no_overlap"}, report["errors"]
    assert "no decode graphs here" in report["errors"]["decode_step"]
    assert set(report["paths"]) == {"in_process", "grpc"}
    assert set(report["throughput"]) == {"in_process", "grpc"}
    for fig in report["throughput"].values():
        assert fig["useful_output_tokens"] == useful
    assert report["paths"]["grpc"]["vs_in_process"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))  # as saved

    monkeypatch.setattr(gpu, "step_times", lambda engine, peak, **_: [{"batch": 1}])
    # the other parts' figures stay; int8 runs, bf16 beside it; a kind that fails is its own
    again = gpu.main([*common, "--parts", "engine,quantized", "--quantizations", "int8,int3"])
    assert set(again["errors"]) == {"grpc_no_overlap", "quantized"}
    assert again["decode_step"] == [{"batch": 1}]
    assert again["paths"]["grpc"] == report["paths"]["grpc"]
    assert again["decode_kernel"] == [{"batch": 1}]
    assert set(again["quantized"]) == {"bf16", "int8", "int3"}
    assert again["quantized"]["int8"]["logits_ok"] is True
    assert "int3" in again["quantized"]["int3"]["error"]


def test_online_load_generator_tiny(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (matplotlib)")
    out = tmp_path / "online.json"
    report = online.main(
        [
            "--launch",
            "--preset",
            "tiny",
            "--arrival",
            "sequential",
            "--concurrencies",
            "1,4",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    runs = report["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    for r in runs:
        assert r["completed"] == r["requests"] == PRESETS["tiny"].num_requests and not r["errors"]
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["kv_waste"] is None or 0 <= r["kv_waste"]["mean"] < 1
    assert [Path(p).name for p in report["plots"]] == ["online_throughput_vs_concurrency.png"]
    assert (tmp_path / "online_throughput_vs_concurrency.png").stat().st_size > 1000


def test_online_random_workload_of_more_requests_than_its_preset() -> None:
    """--num-requests above the preset's count runs that many (it was cut to the preset's
    4 for tiny, silently), the first ones the preset's own."""
    work = online.build_workload("random", 10, "tiny", seed=0)
    assert len(work) == 10 and work[:4] == make_workload(PRESETS["tiny"], 0)
    assert online.build_workload("random", 2, "tiny", seed=0) == work[:2]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--preset", "nosuch"], "invalid choice: 'nosuch'"),
        (["--rate", "0"], "--rate must be a positive number for --arrival poisson"),
        (["--arrival", "fixed", "--rate", "-1"], "--rate must be a positive number"),
        (["--rates", "0.5,0"], "--rates must be positive numbers"),
        (["--concurrencies", "4,0"], "--concurrencies and --max-concurrency must be at least 1"),
        (["--num-requests", "-3"], "--num-requests must be at least 0"),
        (["--launch", "--control", "127.0.0.1:9"], "--control samples a stack given by --url"),
    ],
)
def test_online_bad_flags_are_usage_errors(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any request (or stack): a rate of 0 was a ZeroDivisionError once the runs
    began, an unknown preset a KeyError."""
    with pytest.raises(SystemExit) as stop:
        online.main(["--url", "http://127.0.0.1:9", *args, "--out", "/nonexistent/o.json"])
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_online_url_with_no_gateway_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listening at --url stops before any run, naming it (it was httpx's
    ConnectError in a traceback at the warm-up's first request)."""
    from hetero_infer.local import free_port

    url, out = f"http://127.0.0.1:{free_port()}", tmp_path / "o.json"
    with pytest.raises(SystemExit) as stop:
        online.main(["--url", url, "--preset", "tiny", "--out", str(out), "--no-progress"])
    assert stop.value.code == 2 and not out.exists()
    assert f"--url {url}: no gateway to benchmark there: GET /v1/models failed" in (
        capsys.readouterr().err
    )


def test_online_control_with_no_control_plane_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing at --control stops before any run, naming it: its KV sampler's gRPC error
    was raised at the end of the run, after every request, and the report was lost."""
    from hetero_infer.local import free_port

    monkeypatch.setattr(online, "served_model", lambda url: "m")  # (a gateway at --url)
    control, out = f"127.0.0.1:{free_port()}", tmp_path / "o.json"
    with pytest.raises(SystemExit) as stop:
        online.main(["--url", "http://127.0.0.1:9", "--control", control, "--out", str(out)])
    assert stop.value.code == 2 and not out.exists()
    assert (
        f"--control {control}: no control plane to sample there: ModelInfo failed: UNAVAILABLE"
        in capsys.readouterr().err
    )


def test_online_kv_sampler_failing_mid_run_keeps_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A control plane that stops answering mid-run: the run's figures are kept, and the
    report says why sampling stopped (the sampler's error ended the run in a traceback,
    after every request, and nothing was written)."""
    from hetero_infer.local import free_port

    real, dead = online.kv_waste, f"127.0.0.1:{free_port()}"
    calls: list[str] = []

    def kv_waste(control: str) -> float | None:  # the first sample, then nothing there
        calls.append(control)
        return real(control if len(calls) == 1 else dead)

    monkeypatch.setattr(online, "kv_waste", kv_waste)
    out = tmp_path / "online.json"
    args = ["--launch", "--preset", "tiny", "--arrival", "fixed", "--rate", "4"]
    report = online.main([*args, "--out", str(out), "--no-progress"])
    (r,) = report["runs"]
    assert r["completed"] == r["requests"] == PRESETS["tiny"].num_requests and not r["errors"]
    assert len(calls) == 2  # (fixed arrivals at 4/s: a run of over 1 s, a sample per 0.25 s)
    assert r["kv_waste_error"].startswith("ModelInfo failed: UNAVAILABLE")
    assert r["kv_waste"] is None or r["kv_waste"]["samples"] == 1
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))


def test_control_plane_overhead_tiny(tmp_path: Path) -> None:
    args = ["--seqs", "2", "--steps", "20", "--stream-intervals", "1,4"]
    report = overhead.main([*args, "--out", str(tmp_path / "o.json")])
    runs = report["results"]
    assert [(r["api"], r["running_sequences"], r["stream_interval"]) for r in runs] == [
        ("generate_many", 2, 1),
        ("generate_many", 2, 4),
        ("generate", 2, 1),
        ("generate", 2, 4),
    ]
    for r in runs:
        assert r["steps_measured"] >= 10
        assert 0 < r["ms_per_step_p50"] <= r["ms_per_step_p99"]
        parts = r["in_process"]
        assert set(parts) == {
            "schedule_ms",
            "build_step_ms",
            "wire_ms",
            "update_ms",
            "outputs_ms",
            "total_ms",
        }
        assert all(v > 0 for v in parts.values())
        assert parts["total_ms"] >= max(v for k, v in parts.items() if k != "total_ms")


def test_gpu_variants_unknown_part_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A --parts typo measured nothing and wrote a report without figures (where a GPU
    was lent: its time spent); it is refused before anything runs."""
    from benchmarks import gpu_variants

    with pytest.raises(SystemExit) as stop:
        gpu_variants.main(["--parts", "attn,linears", "--out", "/nonexistent/v.json"])
    assert stop.value.code == 2 and "--parts: unknown attn" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--planes", "1,x"], "--planes must be comma-separated counts"),
        (["--planes", "1,1000"], "--planes: each count must be in 1.."),
        (["--requests", "0"], "--requests must be at least 1"),
    ],
)
def test_scale_bad_flags_are_usage_errors(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before the first run: a plane count above the CPUs was local_planes'
    ValueError (naming serve's --compute-planes) once the runs before it had been
    measured, and lost."""
    from benchmarks import scale

    with pytest.raises(SystemExit) as stop:
        scale.main([*args, "--out", "/nonexistent/s.json"])
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_gpu_benchmarks_logit_probe_on_cpu(tmp_path: Path) -> None:
    """benchmarks.gpu's FP8/INT8 logit comparison (the throughput needs CUDA), on a tiny
    model in bf16 on the CPU: 80 positions each, within the stated tolerances of bf16."""
    from benchmarks import gpu
    from compute_plane.config import ComputeConfig
    from compute_plane.engine import Engine, load_for
    from tests.conftest import make_tiny_model

    make_tiny_model("llama", tmp_path)
    logits = {}
    for kind in ("none", "fp8", "int8"):
        cfg = ComputeConfig(
            model=str(tmp_path), dtype="bfloat16", quantization=kind, kv_cache_bytes=64 << 20
        )
        engine = Engine(cfg, load_for(cfg, tmp_path))
        logits[kind] = gpu._prompt_logits(engine, engine.model_config.vocab_size)
        assert logits[kind].shape == (80, engine.model_config.vocab_size)
    top = logits["none"].abs().max()
    for kind, tol in gpu.STATED_LOGIT_TOLERANCE.items():
        rel = (logits[kind] - logits["none"]).abs().max() / top
        assert 0 < rel <= tol, (kind, rel)


def test_quant_kernel_benchmark_tiny(tmp_path: Path) -> None:
    """Every shape at each row count, with the three ways timed (the benchmark itself
    checks the kernel's product against the dense GEMM before it times it)."""
    report = quant_kernel.main(
        ["--rows", "1,9", "--budget", "0", "--out", str(tmp_path / "q.json")]
    )
    assert json.loads((tmp_path / "q.json").read_text())["results"] == report["results"]
    got = {(r["shape"], r["rows"]) for r in report["results"]}
    assert got == {(s, m) for s in quant_kernel.SHAPES for m in (1, 9)}
    for r in report["results"]:
        assert min(r["kernel_us"], r["dequantize_gemm_us"], r["gemm_dense_us"]) > 0


def test_compute_host_benchmark_tiny(tmp_path: Path) -> None:
    """The compute plane's host work per decode step, this tree in a subprocess: every
    part timed, and the parts add up to the step."""
    out = tmp_path / "h.json"
    report = compute_host.main(["--seqs", "4", "--steps", "14", "--runs", "1", "--out", str(out)])
    assert json.loads(out.read_text())["ms_per_step_median"] == report["ms_per_step_median"]
    fig = report["ms_per_step_median"]["this"]
    assert min(fig["prepare"], fig["forward"], fig["sample"], fig["rest"]) > 0
    parts = fig["prepare"] + fig["forward"] + fig["sample"] + fig["rest"]
    assert parts == pytest.approx(fig["step"], abs=0.01)


def test_compute_host_through_the_grpc_server_tiny(tmp_path: Path) -> None:
    """`--grpc`: the server process's CPU per step, by thread. With `--engine-thread off`
    the engine runs on the event loop's thread, so that thread does nearly all of it."""
    out = tmp_path / "g.json"
    args = ["--grpc", "--seqs", "4", "--steps", "30", "--runs", "1", "--out", str(out)]
    report = compute_host.main([*args, "--compute-arg=--engine-thread=off"])
    assert report["grpc"] == {"in_flight": 3, "compute_args": ["--engine-thread=off"]}
    fig = report["ms_per_step_median"]["this"]
    assert min(fig["period"], fig["prepare"], fig["forward"], fig["sample"]) > 0
    assert fig["server_cpu"] == pytest.approx(fig["loop_thread"] + fig["other_threads"], abs=0.01)
    assert fig["loop_thread"] >= 0.8 * fig["server_cpu"], fig


def test_decode_step_scales_comparison_tiny(tmp_path: Path) -> None:
    """--compare-scales: the bundled model's weights as loaded (fp16 scales: its Q4_1 and
    Q8_0 store fp16 ones) read fewer bytes than the same widened to fp32, by exactly the
    scales' 2 bytes saved per group of 32 weights; both steps timed."""
    out = tmp_path / "scales.json"
    report = decode_step.main(["--shapes", "1x20,3x40", "--compare-scales", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))  # as saved
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader

    per_group = {QT.Q4_1: 4, QT.Q8_0: 2}  # bytes saved: q4's s and b, q8's s
    tensors = GGUFReader(bundled_gguf()).tensors
    saved = sum(per_group.get(t.tensor_type, 0) * int(t.n_elements) // 32 for t in tensors)
    got = report["fp32_scales_weight_mb"] - report["weight_mb"]
    assert got == pytest.approx(saved / 1e6, abs=0.15)  # (each figure rounded to 0.1 MB)
    assert [(r["batch"], r["context"]) for r in report["steps"]] == [(1, 20), (3, 40)]
    for r in report["steps"]:
        assert r["loaded_ms"] > 0 and r["fp32_scales_ms"] > 0 and r["steps_each"] == 5


@pytest.mark.parametrize("bench", [compute_host, decode_step, quant_kernel])
def test_compare_ref_not_a_commit_is_a_usage_error(
    bench: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --compare-ref git does not know stops before anything loads or is written,
    naming the flag (it was git's exit status in a traceback, after the model had loaded,
    and benchmarks.compute_host left its temporary model behind)."""
    import tempfile

    out, temp = tmp_path / "r.json", tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.raises(SystemExit) as stop:
        bench.main(["--compare-ref", "no-such-rev", "--out", str(out)])
    assert stop.value.code == 2
    assert "--compare-ref: 'no-such-rev' is not a commit of" in capsys.readouterr().err
    assert not out.exists() and not any(temp.iterdir())


def test_decode_step_profile_tiny(tmp_path: Path) -> None:
    """By default the weights serve runs (the bundled GGUF's 4-bit matrices, --quantization
    auto), a decode step by the fused C call as served; it timed them dequantized to fp32."""
    args = ["--shapes", "2x20", "--prefills", "24"]
    report = decode_step.main([*args, "--out", str(tmp_path / "d.json")])
    assert report["machine"]["cpu"]  # (what the figures were measured on)
    assert (report["quantization"], report["weights"]) == ("auto", "q4")
    (prefill,) = report["prefills"]
    assert prefill["prefill_tokens"] == 24 and prefill["torch_ms"] > 0 and prefill["cpu_ms"] > 0
    (row,) = report["steps"]
    assert row["batch"] == 2 and row["torch_ms"] > 0 and row["cpu_ms"] > 0 and row["fused"]
    assert "cpu_mkl_ms" not in row  # (no dense matrix for MKL or oneDNN to run)
    for backend in ("torch", "cpu"):
        assert abs(sum(row[f"profile_{backend}"].values()) - 1) < 0.01
    assert row["profile_torch"]["quantized matmul (C kernel)"] > 0
    assert row["profile_cpu"]["fused decode step (C kernel)"] > 0.5  # (the whole forward)


def test_decode_step_profile_of_dense_weights_tiny(tmp_path: Path) -> None:
    args = ["--shapes", "2x20", "--prefills", "", "--quantization", "none"]
    report = decode_step.main([*args, "--out", str(tmp_path / "d.json")])
    assert (report["quantization"], report["weights"]) == ("none", "fp32")
    (row,) = report["steps"]
    assert row["batch"] == 2 and not row["fused"] and row["cpu_mkl_ms"] > 0
    for backend in ("torch", "cpu"):
        assert abs(sum(row[f"profile_{backend}"].values()) - 1) < 0.01
        assert row[f"profile_{backend}"]["matmul"] > 0
    assert row["profile_cpu"]["attention (C kernel)"] > 0  # the kernel's time is attributed
    assert "attention (C kernel)" not in row["profile_torch"]


def test_peers_side_by_side_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ours (quantized) on a tiny workload; llama-server skipped when absent."""
    monkeypatch.setattr(peers, "SINGLE", Preset(1, (8, 8), (6, 6)))
    monkeypatch.setattr(peers, "MIXED", Preset(3, (8, 16), (4, 8)))
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    out = tmp_path / "peers.json"
    report = peers.main(["--skip-fp32", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=list))
    assert set(report["servers"]) == {"ours_quantized"}
    for server in report["servers"].values():
        one, many = server["quiet"]["batch_1"], server["quiet"]["concurrent_24"]
        assert one["output_tokens"] == 6 and one["decode_tokens_per_s"] > 0
        # The compute plane's own mean decode step: part of each gap between two tokens
        # (each gap holds one decode step), so below their mean; a median can sit under a
        # mean that one slow step raised.
        assert 0 < one["compute_decode_step_ms"] < one["itl_mean_ms"]
        assert many["errors"] == 0 and many["requests"] == 3
        assert 3 * 4 <= many["output_tokens"] <= 3 * 8


def test_peers_report_keeps_the_parts_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report is written after each part (a server, quiet or busy), the parts not
    measured listed: a stack that failed to start, or a run interrupted, kept nothing (the
    report was written at the end only)."""
    import contextlib

    state = {"busy": False, "interrupt_busy": False}

    @contextlib.contextmanager
    def ours(gguf: Path, quantization: str) -> Iterator[tuple[str, None]]:
        if quantization == "none":
            raise RuntimeError("the fp32 stack did not start")
        yield "http://127.0.0.1:9", None

    @contextlib.contextmanager
    def busy_loop(on: bool) -> Iterator[None]:
        state["busy"] = on
        yield

    async def batch_one_split(*_: Any) -> dict[str, Any]:
        return {"decode_tokens_per_s": 10.0}

    async def concurrent(*_: Any) -> dict[str, Any]:
        if state["busy"] and state["interrupt_busy"]:
            raise KeyboardInterrupt
        return {"output_tokens_per_s": 8.0}

    for name, fake in [("ours", ours), ("busy_loop", busy_loop), ("concurrent", concurrent)]:
        monkeypatch.setattr(peers, name, fake)
    monkeypatch.setattr(peers, "batch_one_split", batch_one_split)
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    out = tmp_path / "peers.json"
    measured = {
        "batch_1": {"decode_tokens_per_s": 10.0},
        "concurrent_24": {"output_tokens_per_s": 8.0},
    }

    with pytest.raises(RuntimeError, match="the fp32 stack did not start"):
        peers.main(["--busy", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["servers"] == {"ours_quantized": {"quiet": measured, "busy": measured}}
    assert report["ratios"] == {"concurrent_24_busy_vs_quiet": 1.0}
    assert report["unfinished"] == ["ours_fp32/quiet", "ours_fp32/busy"]
    assert report["failed"] == {"ours_fp32": "RuntimeError: the fp32 stack did not start"}

    state["interrupt_busy"] = True  # Ctrl-C in the busy part: the quiet one is kept
    with pytest.raises(KeyboardInterrupt):
        peers.main(["--busy", "--skip-fp32", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["servers"] == {"ours_quantized": {"quiet": measured}}
    assert report["unfinished"] == ["ours_quantized/busy"] and "failed" not in report
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]  # (no temporary file left)


def _failing(after: int, error: BaseException, result: Any) -> Any:
    """A fake measurement: `result` (called with the call's arguments, if callable) for
    its first `after` calls, then `error` raised."""
    calls = itertools.count()

    def fake(*args: Any, **kwargs: Any) -> Any:
        if next(calls) >= after:
            raise error
        return result(*args, **kwargs) if callable(result) else result

    return fake


def test_online_report_keeps_the_runs_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report is written after each run of a sweep, the runs not made listed, the one
    that raised (or its stack's start) named: a run failing or interrupted part way lost
    every run before (the report was written at the end only)."""
    import contextlib

    async def measured(url: str, work: list[Any], *_: Any) -> Any:
        samples = [online.Sample(0.0, 0.1, 0.2, [0.1, 0.2], r.output_len) for r in work]
        return samples, 1.0, online.KvSamples()

    monkeypatch.setattr(online, "served_model", lambda url: "m")
    monkeypatch.setattr(online, "machine", lambda: {"cpu": "test"})
    # the warm-up and the first run, then the second raises
    monkeypatch.setattr(online, "run", _failing(2, RuntimeError("the gateway went"), measured))
    out = tmp_path / "online.json"
    args = ["--preset", "tiny", "--out", str(out), "--no-progress"]
    with pytest.raises(RuntimeError, match="the gateway went"):
        online.main(["--url", "http://127.0.0.1:9", "--concurrencies", "1,2,4", *args])
    report = json.loads(out.read_text())
    assert [(r["sweep"], r["max_concurrency"], r["completed"]) for r in report["runs"]] == [
        ("concurrency", 1, 4)
    ]
    assert report["unfinished"] == ["concurrency=2", "concurrency=4"]
    assert report["failed"] == {"concurrency=2": "RuntimeError: the gateway went"}

    @contextlib.contextmanager
    def launched(model: str, control_args: tuple[str, ...] = ()) -> Iterator[tuple[str, None]]:
        if "--no-enable-prefix-caching" in control_args:
            raise RuntimeError("the second stack did not start")
        yield "http://127.0.0.1:9", None

    monkeypatch.setattr(online, "launched", launched)
    monkeypatch.setattr(online, "run", measured)
    with pytest.raises(RuntimeError, match="the second stack did not start"):
        online.main(["--launch", "--compare-prefix-caching", *args])
    report = json.loads(out.read_text())
    assert [(r["sweep"], r["prefix_caching"]) for r in report["runs"]] == [("single", True)]
    assert report["unfinished"] == ["prefix_caching=off/single"]
    assert report["failed"] == {
        "prefix_caching=off/launch": "RuntimeError: the second stack did not start"
    }
    assert [p.name for p in tmp_path.iterdir()] == ["online.json"]  # (no temporary file left)


def test_offline_report_keeps_the_parts_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ours in-process measured, then HF failing: the report keeps ours (it was written
    at the end only)."""
    ours = {"system": "ours", "output_tokens_per_s": 10.0}
    monkeypatch.setattr(offline, "machine", lambda: {"cpu": "test", "load_average": [0, 0, 0]})
    monkeypatch.setattr(offline, "run_ours", lambda *_: ours)
    monkeypatch.setattr(offline, "run_hf", _failing(0, RuntimeError("no transformers"), None))
    out = tmp_path / "offline.json"
    with pytest.raises(RuntimeError, match="no transformers"):
        offline.main(["--preset", "tiny", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["runs"] == [ours]
    assert report["unfinished"] == ["hf", "gateway"]
    assert report["failed"] == {"hf": "RuntimeError: no transformers"}


def test_overhead_report_keeps_the_counts_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted at the second count: the first is kept, the rest listed (nothing was
    written)."""
    monkeypatch.setattr(overhead, "machine", lambda: {"cpu": "test"})
    measured = _failing(1, KeyboardInterrupt(), lambda n, *_: {"running_sequences": n})
    monkeypatch.setattr(overhead, "measure", measured)
    monkeypatch.setattr(overhead, "breakdown", lambda *_: {"total_ms": 1.0})
    out = tmp_path / "overhead.json"
    with pytest.raises(KeyboardInterrupt):
        overhead.main(["--seqs", "1,2", "--stream-intervals", "1,4", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["results"] == [{"running_sequences": 1, "in_process": {"total_ms": 1.0}}]
    assert (
        report["unfinished"]
        == [
            f"{api}/stream_interval={i}/seqs={n}"
            for api in ("generate_many", "generate")
            for i in (1, 4)
            for n in (1, 2)
        ][1:]
    )
    assert "failed" not in report


def test_overhead_unknown_api_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Before any control plane starts (it was a KeyError after the harness had started)."""
    with pytest.raises(SystemExit) as stop:
        overhead.main(["--apis", "generate,nosuch", "--out", "/nonexistent/o.json"])
    assert stop.value.code == 2
    assert "--apis: unknown nosuch (choose from generate_many, generate)" in (
        capsys.readouterr().err
    )


def test_online_prefix_caching_comparison_with_a_session_of_no_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request of the cached session failed: the ratio is null and the report is
    written (it was a TypeError on None after both sessions had run)."""
    import contextlib

    async def measured(url: str, work: list[Any], *_: Any) -> Any:
        cached = "on" in url
        samples = [
            online.Sample(0.0, error="refused") if cached else online.Sample(0.0, 0.1, 0.2)
            for _ in work
        ]
        return samples, 1.0, online.KvSamples()

    @contextlib.contextmanager
    def launched(model: str, control_args: tuple[str, ...] = ()) -> Iterator[tuple[str, None]]:
        on = "--enable-prefix-caching" in control_args
        yield f"http://{'on' if on else 'off'}.invalid", None

    monkeypatch.setattr(online, "served_model", lambda url: "m")
    monkeypatch.setattr(online, "machine", lambda: {"cpu": "test"})
    monkeypatch.setattr(online, "launched", launched)
    monkeypatch.setattr(online, "run", measured)
    out = tmp_path / "online.json"
    argv = ["--launch", "--compare-prefix-caching", "--preset", "tiny", "--out", str(out)]
    online.main([*argv, "--no-progress"])
    report = json.loads(out.read_text())
    assert report["ttft_p50_ratio_off_vs_on"] is None
    assert [r["prefix_caching"] for r in report["runs"]] == [True, False]
    assert report["runs"][0]["ttft_ms"] is None and report["runs"][1]["ttft_ms"] is not None


def test_speculative_report_keeps_the_parts_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 1 measured, then the cross-over failing: batch 1 is kept (the report was
    written at the end only)."""
    from benchmarks import speculative

    rows = [{"config": "off", "output_tok_s": 10.0}]
    monkeypatch.setattr(speculative, "machine", lambda: {"cpu": "test"})
    monkeypatch.setattr(speculative, "make_layer_draft", lambda src, n, out: out)
    monkeypatch.setattr(speculative, "batch_one", lambda *_: rows)
    monkeypatch.setattr(speculative, "concurrency", _failing(0, RuntimeError("no stack"), None))
    out = tmp_path / "speculative.json"
    with pytest.raises(RuntimeError, match="no stack"):
        speculative.main(["--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["batch_1"] == rows
    assert report["unfinished"] == ["concurrency", "default_at_32"]
    assert report["failed"] == {"concurrency": "RuntimeError: no stack"}


def test_step_timeline_tiny(tmp_path: Path) -> None:
    """Over the real gRPC hop: the phases are measured and add up. The model by its name,
    as the planes take it (the engine here reads its tokenizer from the file it names)."""
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    args = ["--model", "default", "--concurrency", "3", "--output-len", "12"]
    report = profile.main([*args, "--out", str(out), "--plot", str(png)])
    ms = report["ms"]
    assert ms["decode_steps"] >= 5 and json.loads(out.read_text())["concurrency"] == 3
    # The scheduling applied, the flags left unset (they were recorded as null): a compute
    # plane on a CPU is driven one step at a time.
    assert (report["async_scheduling"], report["steps_ahead"]) == (False, 1)
    for phase in ("schedule", "encode", "grpc_send", "grpc_return", "update", "forward"):
        assert ms[phase]["mean"] > 0, phase
    # The hops of a step are parts of it (the marks of a step are its own, not those of a
    # step of the untimed warm-up round before it).
    for phase in ("grpc_send", "grpc_return"):
        assert ms[phase]["mean"] < ms["step"]["mean"], phase
    assert ms["compute_idle"]["mean"] >= 0 and 0 <= ms["compute_idle_fraction"] < 1
    # The step is the compute plane busy, then idle until the next one.
    busy_idle = ms["compute_busy"]["mean"] + ms["compute_idle"]["mean"]
    assert busy_idle == pytest.approx(ms["step"]["mean"], rel=1e-3)
    parts = ms["prepare"]["mean"] + ms["forward"]["mean"] + ms["sample"]["mean"]
    assert parts <= ms["compute_busy"]["mean"]
    assert "device_idle" not in ms  # (CUDA events only)
    # Each decode step's own marks, in order, with its phases inside it.
    steps = report["steps"]
    assert len(steps) >= ms["decode_steps"] and steps[0]["schedule_start"] == 0
    for a, b in itertools.pairwise(steps):
        assert a["step_id"] < b["step_id"] and a["compute_received"] <= b["compute_received"]
    for t in steps:
        assert t["schedule_start"] <= t["encoded"] <= t["compute_received"] <= t["compute_replied"]
        assert t["compute_replied"] <= t["result"] <= t["updated"] and t["forward_us"] > 0


def test_step_timeline_of_overlapped_steps_takes_the_device_idle_gap() -> None:
    """Overlapped steps (CUDA): the next step comes while one runs, so the host's gap is
    negative; the device's own gap (StepResult.device_idle_ns) is the idle figure."""
    ms = 1_000_000
    timeline = []
    for k in range(4):  # a step every 10 ms, each arriving 4 ms before the last replies
        at = 100 * ms + k * 10 * ms
        marks = dict(schedule_start=at - 3 * ms, scheduled=at - 3 * ms + 10_000)
        marks |= dict(encoded=at - 3 * ms + 20_000, sent=at - 2 * ms, emitted=at - 2 * ms)
        marks |= dict(compute_received=at, compute_replied=at + 14 * ms)
        marks |= dict(result=at + 15 * ms, updated=at + 15 * ms + 50_000)
        timeline.append(
            marks
            | dict(step_id=k, num_seqs=2, num_tokens=2, prepare_ns=ms, forward_ns=8 * ms)
            | dict(sample_ns=ms, device_idle_ns=[500_000, 200_000, 300_000, 0][k])
        )
    out = profile.analyse(timeline, 2)
    assert out["decode_steps"] == 3  # (the last has no next step to end it)
    assert out["step"]["mean"] == 10.0 and out["compute_idle"]["mean"] == -4.0
    assert out["device_idle"]["mean"] == round((0.5 + 0.2 + 0.3) / 3, 3)  # (ms to 3 places)
    assert out["device_idle_fraction"] == round((0.5 + 0.2 + 0.3) / 3 / 10, 3)


def test_layer_draft_is_the_models_first_layers(tmp_path: Path) -> None:
    """benchmarks.speculative's small draft: the bundled GGUF's first layers, its embeddings,
    output and tokenizer, the quantized tensors copied as they are."""
    import torch

    from benchmarks.speculative import make_layer_draft
    from compute_plane.loader import load_model
    from control_plane.tokenizer import load_tokenizer
    from hetero_common.model_path import bundled_gguf

    src = bundled_gguf()
    draft = make_layer_draft(src, 2, tmp_path / "draft.gguf")
    full, cut = load_model(src, progress=False), load_model(draft, progress=False)
    assert cut.config.num_layers == 2 and full.config.num_layers > 2
    assert cut.config.vocab_size == full.config.vocab_size
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(cut.weights[name], full.weights[name]), name
    assert "model.layers.2.mlp.down_proj.weight" not in cut.weights
    text = "Speculative decoding, drafted."
    assert load_tokenizer(draft).encode(text) == load_tokenizer(src).encode(text)


def test_startup_benchmark_tiny(tmp_path: Path) -> None:
    """Both ways reach /ready; the one-by-one run's parts add up to its total."""
    out = tmp_path / "startup.json"
    report = startup.main(["--runs", "1", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == report["runs"]
    assert report["machine"]["cpu"]
    (together,) = report["runs"]["together"]
    (one,) = report["runs"]["one_by_one"]
    assert together["ready_s"] > 0 and one["ready_s"] > 0
    parts = one["compute_s"] + one["control_s"] + one["gateway_s"]
    assert abs(parts - one["ready_s"]) < 0.01
    ratio = report["together_vs_one_by_one"]
    assert ratio == round(together["ready_s"] / one["ready_s"], 3)
