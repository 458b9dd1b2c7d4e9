"""Prompts and outputs stay out of the logs at the default level (INFO), in all three planes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hetero_infer.local import free_port, stop_process, wait_http_ready, wait_serving

pytestmark = pytest.mark.slow

SECRET = "Zanzibar-7f3a-confidential"


@contextlib.contextmanager
def _three_planes(
    tmp_path: Path, flags: tuple[str, ...] = (), stdout_too: bool = True
) -> Iterator[tuple[str, dict[str, Path]]]:
    """The three planes as processes (with `flags` after each subcommand), each logging to
    a file (stderr, and stdout with `stdout_too`); yields the gateway URL and the files."""
    kport, cport, gport = free_port(), free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{cport}"
    planes = {
        "compute": ["compute-plane", *flags, "--port", str(kport)],
        "control": ["control-plane", *flags, "--port", str(cport), "--compute", compute],
        "gateway": ["gateway", *flags, "--port", str(gport), "--control", control],
    }
    planes["compute"] += ["--kv-cache-bytes", str(64 << 20), "--metrics-port", str(free_port())]
    planes["control"] += ["--metrics-port", str(free_port())]
    procs: list[subprocess.Popen[bytes]] = []
    logs = {name: tmp_path / f"{name}.log" for name in planes}
    try:
        for name, args in planes.items():
            with logs[name].open("wb") as out:
                cmd = [sys.executable, "-m", "hetero_infer.cli", *args]
                if stdout_too:
                    procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
                else:
                    procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out))
            if name != "gateway":
                wait_serving(compute if name == "compute" else control, procs[-1])
        url = f"http://127.0.0.1:{gport}"
        wait_http_ready(url + "/ready", procs[-1])
        yield url, logs
    finally:
        for p in reversed(procs):
            stop_process(p)


def test_no_prompt_or_output_in_logs(tmp_path: Path) -> None:
    with _three_planes(tmp_path) as (url, logs):  # the default --log-level
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        outputs = []
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Repeat after me: {SECRET}"}],
            max_tokens=24,
            temperature=0,
        )
        outputs.append(chat.choices[0].message.content or "")
        done = client.completions.create(
            model=model, prompt=f"The code is {SECRET}. The code is", max_tokens=24, temperature=0
        )
        outputs.append(done.choices[0].text)
        for stream in (True, False):  # refused requests carry the prompt too
            r = httpx.post(
                url + "/v1/completions",
                json={"model": model, "prompt": SECRET * 2000, "max_tokens": 1, "stream": stream},
                timeout=60,
            )
            assert r.status_code == 400, r.text
    text = {name: path.read_text(errors="replace") for name, path in logs.items()}
    assert "INFO" in text["control"] and "INFO" in text["compute"]  # logging was on
    assert "POST /v1/completions" in text["gateway"]  # the access log was on
    for name, log in text.items():
        assert SECRET not in log, f"{name} logged the prompt"
        for out in outputs:
            snippet = out.strip()[:40]
            assert len(snippet) < 12 or snippet not in log, f"{name} logged an output: {snippet!r}"


@pytest.mark.parametrize("level", ["WARNING", "INFO"])
def test_gateway_log_level_holds_for_its_http_server(tmp_path: Path, level: str) -> None:
    """--log-level WARNING quiets the gateway's HTTP server too (uvicorn's start-up lines
    and a line per request); at INFO they are logged. They were INFO whatever the level:
    uvicorn was given its own."""
    port, log = free_port(), tmp_path / "gateway.log"
    cmd = [sys.executable, "-m", "hetero_infer.cli", "--log-level", level, "gateway"]
    cmd += ["--port", str(port), "--control", f"127.0.0.1:{free_port()}"]
    with log.open("wb") as out:
        gw = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/health", gw)
    finally:
        stop_process(gw)
    lines = log.read_text().splitlines()
    info = [line for line in lines if " INFO " in line]
    if level == "WARNING":
        assert not info, lines
    else:
        assert any("uvicorn.access" in line and "/health" in line for line in info), lines


def test_json_logs_carry_one_request_id_through_three_planes(tmp_path: Path) -> None:
    """--log-format json: every stderr line of every plane is a JSON object, and the
    client's X-Request-Id names the request in the gateway's, the control plane's and
    the compute plane's lines, and comes back in the response header, errors included."""
    rid, bad_rid = "trace-4b1d-0001", "trace-4b1d-0002"
    json_logs = ("--log-format", "json")  # after the subcommand, as `serve --log-format json`
    with _three_planes(tmp_path, json_logs, stdout_too=False) as (url, logs):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Request-Id": rid},
        )
        assert raw.headers["x-request-id"] == rid
        assert raw.parse().usage.completion_tokens == 4  # type: ignore[union-attr]
        refused = httpx.post(
            url + "/v1/completions",
            json={"model": model, "prompt": "hi", "max_tokens": -1},
            headers={"X-Request-Id": bad_rid},
            timeout=30,
        )
        assert refused.status_code == 400
        assert refused.headers["x-request-id"] == bad_rid  # the body stays OpenAI's own
        made = httpx.get(url + "/v1/models", timeout=30).headers["x-request-id"]
        assert made and made not in (rid, bad_rid)  # one is made when none is given
    for name, path in logs.items():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        records = [json.loads(ln) for ln in lines]  # fails on any line that is not JSON
        assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
        assert any(r.get("request_id") == rid for r in records), f"{name}: no line for {rid}"


class _Collector:
    """A real OTLP/gRPC trace receiver: what the planes' exporters send, as spans."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc

        self.spans: list[tuple[str, Any]] = []  # (service.name, Span)
        collector = self

        class Service(ts_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                for rs in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        collector.spans += [(attrs["service.name"], s) for s in ss.spans]
                return ts.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        ts_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def test_otlp_traces_follow_a_request_through_three_planes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--otlp-traces-endpoint: one span per request in each plane (one per choice in the
    compute plane), each the child of the one before, in the client's trace."""
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    collector = _Collector()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s
    trace_id, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    flags = ("--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}")
    with _three_planes(tmp_path, flags) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=4,
            n=2,
            temperature=0.7,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        )
        assert len(chat.choices) == 2
    collector.server.stop(None)
    ours = [(svc, s) for svc, s in collector.spans if s.trace_id.hex() == trace_id]
    by_name: dict[str, list[Any]] = {}
    for svc, s in ours:
        by_name.setdefault(f"{svc}/{s.name}", []).append(s)
    http = by_name["hetero-gateway/POST /v1/chat/completions"]
    control = by_name["hetero-control-plane/control.generate"]
    compute = by_name["hetero-compute-plane/compute.request"]
    assert len(http) == 1 and len(control) == 1 and len(compute) == 2, sorted(by_name)
    assert http[0].parent_span_id.hex() == client_span
    assert control[0].parent_span_id == http[0].span_id
    assert all(s.parent_span_id == control[0].span_id for s in compute)
    choices = sorted(_attr(s, "hetero.choice").int_value for s in compute)
    assert choices == [0, 1]
    assert _attr(control[0], "gen_ai.usage.output_tokens").int_value == 8
    assert _attr(http[0], "http.response.status_code").int_value == 200
    probes = [s for svc, s in collector.spans if s.name.endswith(("/health", "/ready"))]
    assert not probes  # probes are not traced


def _attr(span: Any, key: str) -> Any:
    return next(a.value for a in span.attributes if a.key == key)
