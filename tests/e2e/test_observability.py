"""A real Prometheus scrapes all three planes while a workload runs through the gateway."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hetero_infer.local import child, free_port, stop_process, wait_http_ready
from tests.procs import FullStack, gateway, gateway_stack

pytestmark = pytest.mark.slow
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


@pytest.fixture(scope="module")
def stack() -> Iterator[FullStack]:
    with gateway_stack(("--kv-cache-bytes", str(64 << 20))) as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(stack: FullStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if PROMETHEUS is None:
        pytest.fail("prometheus is not installed (.ci/run installs the Debian package)")
    d: Path = tmp_path_factory.mktemp("prom")
    gw = stack.url.removeprefix("http://")
    (d / "prometheus.yml").write_text(
        f"""
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: gateway
    static_configs: [{{targets: ["{gw}"]}}]
  - job_name: control-plane
    static_configs: [{{targets: ["127.0.0.1:{stack.control_metrics}"]}}]
  - job_name: compute-plane
    static_configs: [{{targets: ["127.0.0.1:{stack.compute_metrics}"]}}]
"""
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={d / 'prometheus.yml'}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/-/ready", proc, timeout=60)  # type: ignore[arg-type]
        yield url
    finally:
        stop_process(proc)  # type: ignore[arg-type]


def _query(prom: str, q: str) -> list[dict]:  # type: ignore[type-arg]
    r = httpx.get(prom + "/api/v1/query", params={"query": q}, timeout=10).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def _scalar(prom: str, q: str) -> float | None:
    res = _query(prom, q)
    return float(res[0]["value"][1]) if res else None


def _eventually(fn, expected, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_prometheus_sees_the_workload(stack: FullStack, prometheus: str) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    served, generated = 0, 0
    for i in range(22):
        extra = {"ignore_eos": True}
        if i % 3 == 0:
            r = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Count to {i}"}],
                max_tokens=3 + i % 5,
                extra_body=extra,
            )
            generated += r.usage.completion_tokens  # type: ignore[union-attr]
        elif i % 3 == 1:
            chunks = list(
                client.completions.create(
                    model=model,
                    prompt=f"Story {i}:",
                    max_tokens=2 + i % 7,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=extra,
                )
            )
            generated += chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
        else:
            r2 = client.completions.create(
                model=model, prompt=f"Fact {i}:", max_tokens=4, n=2, extra_body=extra
            )
            generated += r2.usage.completion_tokens  # type: ignore[union-attr]
        served += 1

    up = _eventually(
        lambda: sorted((x["metric"]["job"], x["value"][1]) for x in _query(prometheus, "up")),
        [("compute-plane", "1"), ("control-plane", "1"), ("gateway", "1")],
    )
    assert up == [("compute-plane", "1"), ("control-plane", "1"), ("gateway", "1")]
    assert (
        _eventually(
            lambda: _scalar(prometheus, "sum(hetero_time_to_first_token_seconds_count)"), served
        )
        == served
    )
    assert (
        _eventually(lambda: _scalar(prometheus, "sum(hetero_generation_tokens_total)"), generated)
        == generated
    )
    assert _eventually(lambda: _scalar(prometheus, "sum(hetero_kv_cache_usage_ratio)"), 0.0) == 0.0
    ok = 'sum(hetero_http_requests_total{route="/v1/completions",status="200"})'
    assert _eventually(lambda: _scalar(prometheus, ok), 14.0) == 14.0
    assert (_scalar(prometheus, "sum(hetero_compute_tokens_per_step_sum)") or 0) > generated
    assert (_scalar(prometheus, "hetero_compute_kv_blocks_allocated") or 0) > 1


@pytest.mark.skipif(PROMTOOL is None, reason="promtool comes with the prometheus package")
def test_promtool_accepts_every_exposition(stack: FullStack) -> None:
    for url in (
        stack.url + "/metrics",
        f"http://127.0.0.1:{stack.control_metrics}/metrics",
        f"http://127.0.0.1:{stack.compute_metrics}/metrics",
    ):
        text = httpx.get(url).text
        assert "hetero_" in text
        res = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert res.returncode == 0, f"{url}: {res.stdout}{res.stderr}"


def test_ready_follows_the_compute_plane() -> None:
    kport, cport, gport = free_port(), free_port(), free_port()
    compute = f"127.0.0.1:{kport}"
    control = f"127.0.0.1:{cport}"
    compute_cmd = ["compute-plane", "--port", str(kport), "--metrics-port", str(free_port())]
    control_cmd = [
        "control-plane",
        "--port",
        str(cport),
        "--compute",
        compute,
        "--metrics-port",
        str(free_port()),
    ]
    with (
        child(compute_cmd, compute) as kproc,
        child(control_cmd, control),
        gateway(control, gport) as base,
    ):
        url = base + "/ready"
        kproc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(url).status_code != 503:
            assert time.monotonic() - killed < 5.0, (
                "/ready still 200 five seconds after the compute plane died"
            )
            time.sleep(0.1)
        with child(compute_cmd, compute):
            restarted = time.monotonic()
            while httpx.get(url).status_code != 200:
                assert time.monotonic() - restarted < 30.0, "/ready did not come back"
                time.sleep(0.2)
            # And it serves again.
            body = {"model": httpx.get(url).json()["model"], "prompt": "Hi", "max_tokens": 2}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text


def _model_names(url: str) -> set[str]:
    """The model_name labels of a plane's hetero_ series."""
    text = httpx.get(url, timeout=10).text
    return set(re.findall(r'^hetero_\w+\{[^}]*model_name="([^"]*)"', text, re.M))


def test_every_plane_labels_its_series_with_the_served_model_name() -> None:
    # vLLM labels its series with --served-model-name; the planes labelled theirs with the
    # model file's name whatever the gateway served it as, and only the gateway had the flag.
    served = ("--served-model-name", "smol-chat")
    with gateway_stack(served, served) as s:  # the gateway: no flag of its own
        assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == ["smol-chat"]
        body = {"model": "smol-chat", "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        for port in (s.control_metrics, s.compute_metrics):
            assert _model_names(f"http://127.0.0.1:{port}/metrics") == {"smol-chat"}
        # A gateway's own flag still names the model to its clients.
        with gateway(s.control, free_port(), "--served-model-name", "other") as url:
            assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["other"]
            r = httpx.post(url + "/v1/completions", json={**body, "model": "other"}, timeout=60)
            assert r.status_code == 200, r.text


def test_serve_passes_the_served_model_name_to_every_plane() -> None:
    port, kmetrics, cmetrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "hetero_infer.cli", "serve", "--port", str(port)]
    cmd += ["--served-model-name", "smol-chat", "--compute-metrics-port", str(kmetrics)]
    cmd += ["--control-metrics-port", str(cmetrics)]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/ready", proc, timeout=300)  # type: ignore[arg-type]
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["smol-chat"]
        for metrics in (kmetrics, cmetrics):
            assert _model_names(f"http://127.0.0.1:{metrics}/metrics") == {"smol-chat"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("plane", ["serve", "control-plane", "compute-plane", "gateway"])
def test_an_empty_served_model_name_is_refused(plane: str) -> None:
    cmd = [sys.executable, "-m", "hetero_infer.cli", plane, "--served-model-name", " "]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "served" in r.stderr and "empty" in r.stderr, r.stderr
