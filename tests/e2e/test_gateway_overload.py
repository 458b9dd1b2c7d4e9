"""Documented 503 and 429 cases: no control plane, and a full waiting queue."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest

from hetero_infer.local import free_port
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.procs import gateway, gateway_stack

pytestmark = pytest.mark.slow


def _waiting(control: str) -> int:
    with grpc.insecure_channel(control) as ch:
        return pb_grpc.ControlPlaneStub(ch).ModelInfo(pb.ModelInfoRequest()).stats.num_waiting


def test_no_control_plane_is_503() -> None:
    with gateway(f"127.0.0.1:{free_port()}", free_port(), url_path="/health") as url:
        assert httpx.get(url + "/ready").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"


def test_full_waiting_queue_is_429() -> None:
    with gateway_stack(
        ("--kv-cache-bytes", str(64 << 20)), ("--max-num-seqs", "1", "--max-waiting", "1")
    ) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        started = threading.Event()

        def long_request() -> None:
            stream = client.completions.create(
                model=model,
                prompt="Tell a story",
                max_tokens=300,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()

        running = threading.Thread(target=long_request)
        running.start()
        assert started.wait(60)
        waiting = threading.Thread(target=long_request)
        waiting.start()
        deadline = time.monotonic() + 30
        while _waiting(s.control) < 1:  # the second request is queued behind the first
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(
            s.url + "/v1/completions",
            json={"model": model, "prompt": "x", "max_tokens": 1},
            timeout=60,
        )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        running.join()
        waiting.join()
        ok = client.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert ok.choices[0].text is not None
        # A batch of more prompts than the queue holds could never be admitted whole:
        # a 400 that names prompt, not a 429 a client would retry forever.
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=["Hi", "Yo"], max_tokens=2)
        assert e.value.status_code == 400
        assert e.value.body["param"] == "prompt", e.value.body  # type: ignore[index]
        assert "--max-waiting 1" in e.value.body["message"], e.value.body  # type: ignore[index]
        one = client.completions.create(model=model, prompt=["Hi"], max_tokens=2, n=2)
        assert len(one.choices) == 2  # n choices of one prompt are not a batch
