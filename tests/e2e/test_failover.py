"""kill -9 the compute plane mid-generation, restart it: every stream finishes, unchanged."""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc
import pytest

from hetero_infer.local import child, free_port
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.e2e_helpers import generate, greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 40


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (5, 40, 12, 90, 3, 60, 25, 8)]


def test_streams_survive_a_compute_plane_crash() -> None:
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
