"""kill -9 the compute plane mid-generation, restart it: every stream finishes, unchanged."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time

import grpc
import httpx
import pytest

from hetero_infer.local import child, free_port, wait_serving
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.e2e_helpers import generate, greedy
from tests.procs import compute_plane, gateway

pytestmark = pytest.mark.slow
MAX_TOKENS = 40


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (5, 40, 12, 90, 3, 60, 25, 8)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_streams_survive_a_compute_plane_crash(async_scheduling: bool) -> None:
    """With async scheduling three steps are in flight when the compute plane dies (two
    planned ahead, as on a GPU): the tokens they would have sampled are forgotten, and the
    requests resume from the rest."""
    kport, cport = free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{cport}"
    compute_cmd = [
        "compute-plane",
        "--port",
        str(kport),
        "--metrics-port",
        "0",
        "--kv-cache-bytes",
        str(64 << 20),
    ]
    control_cmd = [
        "control-plane",
        "--port",
        str(cport),
        "--compute",
        compute,
        "--metrics-port",
        "0",
        *(("--async-scheduling", "--steps-ahead", "2") if async_scheduling else ()),
        *(() if async_scheduling else ("--no-async-scheduling",)),
    ]
    with (
        child(compute_cmd, compute) as kproc,
        child(control_cmd, control),
        grpc.insecure_channel(control) as ch,
    ):
        stub = pb_grpc.ControlPlaneStub(ch)
        expected = [generate(stub, greedy(p, MAX_TOKENS)).tokens[0] for p in _prompts()]

        got: list[list[int]] = [[] for _ in expected]
        errors: list[BaseException] = []

        def run(i: int, prompt: list[int]) -> None:
            try:
                for resp in stub.Generate(greedy(prompt, MAX_TOKENS), timeout=300):
                    for c in resp.choices:
                        got[i].extend(c.token_ids)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(_prompts())]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(g) for g in got) < 5:  # every stream is mid-generation
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)
        kproc.send_signal(signal.SIGKILL)
        kproc.wait()
        assert max(len(g) for g in got) < MAX_TOKENS
        with child(compute_cmd, compute):
            for t in threads:
                t.join(timeout=300)
        assert not errors, errors
        assert got == expected


def test_gateway_reopens_its_call_after_a_control_plane_crash() -> None:
    """The gateway's requests share one GenerateMany call: when the control plane dies,
    those in flight end with 503 (no hang), new ones get 503 at once, and once it is back
    the gateway opens a new call and serves as before."""
    kport, cport = free_port(), free_port()
    control = f"127.0.0.1:{cport}"
    control_cmd = ["control-plane", "--port", str(cport), "--metrics-port", "-1"]
    with contextlib.ExitStack() as stack:
        compute = stack.enter_context(compute_plane("--kv-cache-bytes", str(32 << 20), port=kport))
        control_cmd += ["--compute", compute]
        cproc = stack.enter_context(child(control_cmd, control))
        url = stack.enter_context(gateway(control, free_port()))
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        short = {"model": model, "prompt": "The capital of France is", "max_tokens": 8}
        before = httpx.post(url + "/v1/completions", json={**short, "temperature": 0}, timeout=120)
        assert before.status_code == 200, before.text

        long = {"model": model, "prompt": "Tell a story", "max_tokens": 400, "ignore_eos": True}
        with httpx.stream(
            "POST", url + "/v1/completions", json={**long, "stream": True}, timeout=120
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if '"text"' in line:
                    break  # generating
            cproc.send_signal(signal.SIGKILL)
            cproc.wait()
            rest = "\n".join(lines)
        assert '"error"' in rest and "service_unavailable" in rest, rest[-300:]
        assert rest.rstrip().endswith("data: [DONE]")

        started = time.monotonic()
        down = httpx.post(url + "/v1/completions", json=short, timeout=120)
        assert down.status_code == 503, down.text
        assert "127.0.0.1" not in down.text and control not in rest  # no internal address
        assert time.monotonic() - started < 10

        with child(control_cmd, control):
            deadline = time.monotonic() + 60
            while httpx.get(url + "/ready").status_code != 200:
                assert time.monotonic() < deadline, "the gateway did not become ready again"
                time.sleep(0.2)
            after = httpx.post(
                url + "/v1/completions", json={**short, "temperature": 0}, timeout=120
            )
            assert after.status_code == 200, after.text
            assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_a_compute_plane_killed_idle_is_noticed_at_once_and_taken_back() -> None:
    """A compute plane killed while idle: the control plane notices by its step stream's
    end, at once (not from two missed health checks, 0.5 s apart): a request then is
    refused (UNAVAILABLE, no compute plane) instead of waiting, and once the plane is back
    it is attached again and serves as before. (In that window a step was written to the
    finished stream; grpc's InvalidStateError ended the step loop: the request hung and
    the plane was never attached again. tests/control/test_link_end.py covers that write.)"""
    kport, cport = free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{cport}"
    compute_cmd = ["compute-plane", "--port", str(kport), "--metrics-port", "-1"]
    compute_cmd += ["--kv-cache-bytes", str(32 << 20)]
    control_cmd = ["control-plane", "--port", str(cport), "--compute", compute]
    control_cmd += ["--metrics-port", "-1"]
    prompt = _prompts()[0]
    with contextlib.ExitStack() as stack:
        kproc = stack.enter_context(child(compute_cmd, compute))
        cproc = stack.enter_context(child(control_cmd, control))
        stub = pb_grpc.ControlPlaneStub(stack.enter_context(grpc.insecure_channel(control)))
        expected = generate(stub, greedy(prompt, 8)).tokens[0]
        time.sleep(0.5)  # the step loop is idle (the step that releases the request is back)
        kproc.send_signal(signal.SIGKILL)
        kproc.wait()
        time.sleep(0.2)  # the stream has ended; the watchdog has not missed twice yet
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, greedy(prompt, 8), timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        with child(compute_cmd, compute):
            wait_serving(control, cproc)
            assert generate(stub, greedy(prompt, 8), timeout=60).tokens[0] == expected
