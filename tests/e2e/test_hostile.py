"""Hostile and unlucky input against the three planes as processes: poison requests,
arbitrary Unicode and integers in every field, aborts in the metrics, stalled clients."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from hetero_infer.local import free_port, stop_process, wait_http_ready
from hetero_proto import compute_pb2 as cpb
from hetero_proto import compute_pb2_grpc as cpb_grpc
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.procs import FullStack, control_stack, gateway

pytestmark = pytest.mark.slow

HEADER_TIMEOUT = 2.0
MAX_MODEL_LEN = 96  # a short context keeps every request the fuzzer gets accepted cheap
BODY_TIMEOUT = 5.0  # (the default, 30 s, would be the suite's wait)


@pytest.fixture(scope="module")
def stack() -> Iterator[FullStack]:
    compute = ("--kv-cache-bytes", str(64 << 20), "--max-model-len", str(MAX_MODEL_LEN))
    with (
        control_stack(compute) as s,
        gateway(
            s.control,
            free_port(),
            "--header-timeout",
            str(HEADER_TIMEOUT),
            "--body-timeout",
            str(BODY_TIMEOUT),
        ) as url,
    ):
        yield FullStack(s.compute, s.control, s.compute_metrics, s.control_metrics, url)


@pytest.fixture(scope="module")
def model(stack: FullStack) -> str:
    return str(httpx.get(stack.url + "/v1/models").json()["data"][0]["id"])


def _served(stack: FullStack, model: str) -> None:
    """A normal request is served."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    done = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 3


def _openai_error(r: httpx.Response) -> None:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert "127.0.0.1" not in err["message"] and "Traceback" not in err["message"]


def _compute_stats(stack: FullStack) -> cpb.StatsResponse:
    with grpc.insecure_channel(stack.compute) as ch:
        return cpb_grpc.ComputePlaneStub(ch).Stats(cpb.StatsRequest(), timeout=10)


def test_the_poison_request_is_a_400_at_once(stack: FullStack, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "min_tokens": 1,
        "stop_token_ids": [1_000_000_000],
    }
    t0 = time.monotonic()
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=30)
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 400, r.text
    _openai_error(r)
    assert "stop_token_ids" in r.json()["error"]["message"]
    assert _compute_stats(stack).num_resets == 0
    _served(stack, model)


# ------------------------------------------------------------ gRPC clients
HI = [pb.ChatMessage(role="user", content="Hi")]
TOOL = '{"type": "function", "function": {"name": "f"}}'
DEEP = "[" * 2000 + "]" * 2000  # deeper than Python's stack, small enough to be read
CALL = '[{"type": "function", "function": {"name": "f", "arguments": "' + DEEP + '"}}]'
# Over the size bound (the context x the longest token's bytes) in a field of each kind.
HUGE_TEXT = "x" * 20000
HUGE_CALLS = pb.ChatInput(
    messages=[pb.ChatMessage(role="assistant", tool_calls_json=CALL.replace(DEEP, HUGE_TEXT))]
)
TOO_LONG = f"is longer than the maximum context length of {MAX_MODEL_LEN} tokens"
# Inputs the control plane refuses, by what its message says.
BAD_INPUTS: dict[str, dict[str, Any]] = {
    "tools[0] must be": {"chat": pb.ChatInput(messages=HI, tools_json="[1]")},
    "tools[1] must be": {
        "chat": pb.ChatInput(messages=HI, tools_json=f'[{TOOL}, {{"function": 5}}]')
    },
    "tools_json is nested too deeply": {"chat": pb.ChatInput(messages=HI, tools_json=DEEP)},
    "chat_template_kwargs is nested too deeply": {
        "chat": pb.ChatInput(messages=HI, template_kwargs_json='{"a": ' + DEEP + "}")
    },
    "documents is nested too deeply": {"chat": pb.ChatInput(messages=HI, documents_json=DEEP)},
    "tool_calls_json is nested too deeply": {
        "chat": pb.ChatInput(messages=[pb.ChatMessage(role="assistant", tool_calls_json=DEEP)])
    },
    "arguments nested too deeply": {
        "chat": pb.ChatInput(messages=[pb.ChatMessage(role="assistant", tool_calls_json=CALL)])
    },
    f"the prompt ({len(HUGE_TEXT)} bytes) {TOO_LONG}": {"text": HUGE_TEXT},
    f"the chat ({HUGE_CALLS.ByteSize()} bytes) {TOO_LONG}": {"chat": HUGE_CALLS},
}
# Parameters it refuses (with a good prompt), where it would otherwise ignore or misread them.
BAD_PARAMS: dict[str, pb.GenerationParams] = {
    "top_logprobs needs logprobs": pb.GenerationParams(top_logprobs=2),
    "stop strings must not be empty": pb.GenerationParams(stop=[""]),
    "top_k must be": pb.GenerationParams(top_k=-5),
    "json_object must be true": pb.GenerationParams(
        structured=pb.StructuredOutput(json_object=False)
    ),
}


def _refusal(call: Any, request: Any) -> tuple[str, str]:
    """The status code's name and the message of a call that must fail."""
    with pytest.raises(grpc.RpcError) as e:
        reply = call(request, timeout=60)
        if isinstance(reply, Iterator):  # a streamed reply fails when read
            list(reply)
    return e.value.code().name, e.value.details() or ""


def test_bad_grpc_input_is_invalid_argument_on_every_rpc(stack: FullStack, model: str) -> None:
    """Each bad input or parameter is INVALID_ARGUMENT naming its problem (not UNKNOWN
    with a trace, nor ignored) from Generate, from GenerateMany (its RequestError) and, an
    input, from Tokenize; the stack goes on serving."""
    calls = {k: {**v, "params": pb.GenerationParams(max_tokens=2)} for k, v in BAD_INPUTS.items()}
    calls |= {k: {"text": "Hi", "params": v} for k, v in BAD_PARAMS.items()}
    with grpc.insecure_channel(stack.control) as ch:
        stub = pb_grpc.ControlPlaneStub(ch)
        for needle, fields in calls.items():
            code, message = _refusal(stub.Generate, pb.GenerateRequest(**fields))
            assert code == "INVALID_ARGUMENT" and needle in message, (needle, code, message)
        for needle, fields in BAD_INPUTS.items():
            code, message = _refusal(stub.Tokenize, pb.TokenizeRequest(**fields))
            assert code == "INVALID_ARGUMENT" and needle in message, (needle, code, message)
        starts = [
            pb.GenerateManyRequest(start=pb.GenerateRequest(request_id=needle, **fields))
            for needle, fields in calls.items()
        ]
        errors = [e for m in stub.GenerateMany(iter(starts), timeout=60) for e in m.errors]
    # (each request's id is what its message must say)
    got = {e.request_id: (e.code, e.request_id in e.message) for e in errors}
    assert got == dict.fromkeys(calls, ("INVALID_ARGUMENT", True))
    _served(stack, model)


# ----------------------------------------------------------------- fuzzing
WIDE_INT = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=8),  # small: what is accepted stays cheap
)
TEXT = st.text(  # any code point, lone surrogates and control characters included
    alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()),
    max_size=12,
)
SCALAR = st.one_of(TEXT, WIDE_INT, st.booleans(), st.none(), st.floats(allow_nan=False))
INT_FIELDS = ("max_tokens", "n", "seed", "top_k", "min_tokens", "logprobs", "top_logprobs")
INT_FIELDS += ("max_completion_tokens",)
MAYBE_INT = st.one_of(WIDE_INT, WIDE_INT, SCALAR)  # mostly integers, sometimes not


def _body(draw: st.DrawFn, route: str, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(st.sampled_from([model, model, model]) | TEXT)}
    if route == "completions":
        body["prompt"] = draw(
            TEXT | st.lists(TEXT, min_size=1, max_size=3) | st.lists(WIDE_INT, max_size=4)
        )
    else:
        content = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}))
        body["messages"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "assistant"]), "content": content}
                ),
                min_size=1,
                max_size=3,
            )
        )
    for name in draw(st.lists(st.sampled_from(INT_FIELDS), max_size=4, unique=True)):
        body[name] = draw(MAYBE_INT)
    if draw(st.booleans()):
        body["stop"] = draw(TEXT | st.lists(TEXT, max_size=3))
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(st.lists(WIDE_INT, max_size=3))
    for name in draw(st.lists(st.sampled_from(["user", "stream", "temperature"]), unique=True)):
        body[name] = draw(SCALAR)
    body.setdefault("max_tokens", draw(st.integers(1, 4)))  # keep accepted requests short
    return body


@st.composite
def requests_(draw: st.DrawFn, model: str) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(["completions", "chat/completions"]))
    return route, _body(draw, route.split("/")[0], model)


def test_arbitrary_unicode_and_integers_never_5xx(stack: FullStack, model: str) -> None:
    """≥ 2,000 requests with any string (lone surrogates, control characters) and any
    integer (int64 and beyond) in their fields: each is a 2xx or an OpenAI 4xx, the
    compute plane never resets, and a normal request is served afterwards."""
    seen: dict[int, int] = {}
    with httpx.Client(base_url=stack.url + "/v1", timeout=60) as client:

        @settings(
            max_examples=2000,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(requests_(model))
        def one(case: tuple[str, dict[str, Any]]) -> None:
            route, body = case
            # json.dumps writes a lone surrogate as the "\\ud800" escape, as a client would.
            raw = json.dumps(body)
            r = client.post(route, content=raw, headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text, raw)
            if r.status_code >= 400:
                _openai_error(r)

        one()
    assert sum(seen.values()) >= 2000
    assert seen.get(200, 0) > 50 and sum(n for s, n in seen.items() if s >= 400) > 500, seen
    assert _compute_stats(stack).num_resets == 0
    _served(stack, model)


# ------------------------------------------------------------------ metrics
def _families(url: str) -> list[Any]:
    return list(text_string_to_metric_families(httpx.get(url, timeout=10).text))


def test_aborts_are_counted_and_every_series_names_the_served_model(
    stack: FullStack, model: str
) -> None:
    control_url = f"http://127.0.0.1:{stack.control_metrics}/metrics"

    def finished() -> Counter[str]:
        """hetero_request_success_total by finished_reason."""
        out: Counter[str] = Counter()
        for f in _families(control_url):
            for s in f.samples:
                if s.name == "hetero_request_success_total":
                    out[s.labels["finished_reason"]] += s.value
        return out

    # The earlier tests' cancels went on the gateway's GenerateMany call before this
    # request did, so the control plane has counted them: `before` is settled.
    _served(stack, model)
    before = finished()
    # ignore_eos: about 1 in 70 sampled streams ends with EOS as its second token, which
    # may come before the cancel does (then it is counted as `stop`). 80 tokens (within
    # --max-model-len 96) take about a second, far longer than a cancel.
    body = {
        "model": model,
        "prompt": "Tell a long story",
        "max_tokens": 80,
        "ignore_eos": True,
        "stream": True,
    }
    for _ in range(3):  # a client that leaves mid-stream, after its first token
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            first = json.loads(next(r.iter_lines()).removeprefix("data: "))
            assert first["choices"][0]["text"] and first["choices"][0]["finish_reason"] is None
    deadline = time.monotonic() + 30
    while finished()["abort"] < before["abort"] + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    counted = finished()
    counted.subtract(before)
    assert +counted == Counter(abort=3)  # each an abort, none a stop or length
    for url in (control_url, f"http://127.0.0.1:{stack.compute_metrics}/metrics"):
        labelled = [s for f in _families(url) for s in f.samples if "model_name" in s.labels]
        assert labelled, url
        assert {s.labels["model_name"] for s in labelled} == {model}, url


# ------------------------------------------------------------- slow clients
def test_stalled_headers_are_closed_while_others_are_served(stack: FullStack, model: str) -> None:
    host, port = stack.url.removeprefix("http://").split(":")
    socks = []
    for _ in range(100):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        socks.append(s)
    opened = time.monotonic()
    _served(stack, model)  # meanwhile
    closed = 0
    for s in socks:
        s.settimeout(max(0.1, HEADER_TIMEOUT + 3.0 - (time.monotonic() - opened)))
        try:
            closed += s.recv(1024) == b""  # the server closed it
        except TimeoutError:
            pass  # still open
        except OSError:
            closed += 1  # reset: closed with our unread bytes in its buffer
        s.close()
    assert time.monotonic() - opened < HEADER_TIMEOUT + 4.0
    assert closed == 100
    _served(stack, model)


def test_a_stalled_body_gets_408(stack: FullStack) -> None:
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        opened = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert BODY_TIMEOUT <= time.monotonic() - opened < BODY_TIMEOUT + 10.0  # --body-timeout
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"


# ------------------------------------------------------------ two stacks
def test_two_serves_share_a_host() -> None:
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "hetero_infer.cli", "serve", "--port", str(p)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        waits = [
            threading.Thread(target=wait_http_ready, args=(f"http://127.0.0.1:{p}/ready", proc))
            for p, proc in zip(ports, procs, strict=True)
        ]
        for w in waits:
            w.start()
        for w in waits:
            w.join()
        for p in ports:
            url = f"http://127.0.0.1:{p}"
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Hi", "max_tokens": 2}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        for proc in procs:
            stop_process(proc)
