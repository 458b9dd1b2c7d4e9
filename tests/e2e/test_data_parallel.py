"""One control plane, several compute planes (data parallel): placement, failover, joins.

Real processes: compute planes and a control plane on loopback, driven through the
control plane's public gRPC API with the bundled model.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from hetero_infer.local import child, free_port, stop_process, wait_http_ready, wait_serving
from hetero_proto import compute_pb2 as cpb
from hetero_proto import compute_pb2_grpc as cpb_grpc
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.e2e_helpers import generate, greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
# Long enough that the streams still run on both planes when one leaves (~5 tokens in,
# the file read every 0.3 s; ~7 tokens/s a stream here), short enough to be cheap.
LONG_TOKENS = 80


def _compute_cmd(port: int) -> list[str]:
    # Exact fp32 activations: these tests compare texts against a run with other batches,
    # and with the default int16 activations a decode row computed in a mixed step (the
    # torch forward) differs from the fused decode step's by ~2e-3 in its logits, enough to
    # flip a near tie of these random-token prompts (it did once in CI). fp32: ~2e-5.
    return [
        "compute-plane",
        "--port",
        str(port),
        "--metrics-port",
        "-1",
        "--num-threads",
        "1",
        "--kv-cache-bytes",
        str(64 << 20),
        "--cpu-activations",
        "fp32",
    ]


def _control_cmd(port: int, metrics_port: int, compute: str, *extra: str) -> list[str]:
    return [
        "control-plane",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--compute",
        compute,
        "--compute-timeout",
        "600",  # a request waiting for a dead plane would show as a test timeout
        *extra,
    ]


@contextlib.contextmanager
def _computes(n: int) -> Iterator[tuple[list[str], list[subprocess.Popen[bytes]]]]:
    ports = [free_port() for _ in range(n)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(child(_compute_cmd(p), a))
            for p, a in zip(ports, addresses, strict=True)
        ]
        yield addresses, procs


def _stats(address: str) -> cpb.StatsResponse:
    with grpc.insecure_channel(address) as ch:
        return cpb_grpc.ComputePlaneStub(ch).Stats(cpb.StatsRequest(), timeout=30)


def _metric(url: str, name: str, **labels: str) -> float:
    """One sample of the control plane's /metrics (0 when absent)."""
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (5, 40, 12, 90, 3, 60, 25, 8)]


class _Streams:
    """Greedy streams on threads, their tokens collected as they come."""

    def __init__(
        self, stub: pb_grpc.ControlPlaneStub, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
    ) -> None:
        self.max_tokens = max_tokens
        self.got: list[list[int]] = [[] for _ in prompts]
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(stub, i, p)) for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, stub: pb_grpc.ControlPlaneStub, i: int, prompt: list[int]) -> None:
        try:
            for resp in stub.Generate(greedy(prompt, self.max_tokens), timeout=300):
                for c in resp.choices:
                    self.got[i].extend(c.token_ids)
        except BaseException as e:
            self.errors.append(e)

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while min(len(g) for g in self.got) < n:
            assert time.monotonic() < deadline and not self.errors, self.errors
            time.sleep(0.01)

    def join(self, timeout: float = 300) -> list[list[int]]:
        for t in self.threads:
            t.join(timeout=timeout)
        assert not self.errors, self.errors
        return self.got


def test_streams_survive_one_of_two_compute_planes_dying() -> None:
    """kill -9 one of two compute planes with 8 greedy streams running: its requests move
    to the other at once (the dead plane never comes back; the control plane would wait
    600 s for it), every text equals the uninterrupted run's."""
    cport, cmetrics = free_port(), free_port()
    control = f"127.0.0.1:{cport}"
    url = f"http://127.0.0.1:{cmetrics}/metrics"
    with (
        _computes(2) as (computes, procs),
        child(_control_cmd(cport, cmetrics, ",".join(computes)), control),
        grpc.insecure_channel(control) as ch,
    ):
        stub = pb_grpc.ControlPlaneStub(ch)
        expected = _Streams(stub, _prompts()).join()  # uninterrupted, the same 8 at once
        before = [_stats(a).num_requests_added for a in computes]
        streams = _Streams(stub, _prompts())
        streams.wait_tokens(5)
        added = [_stats(a).num_requests_added - b for a, b in zip(computes, before, strict=True)]
        assert all(n >= 2 for n in added), f"both planes should hold streams: {added}"
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        killed = time.monotonic()
        assert max(len(g) for g in streams.got) < MAX_TOKENS
        assert streams.join() == expected
        assert time.monotonic() - killed < 120
        moved = _metric(url, "hetero_routed_requests_total", compute=computes[1], reason="moved")
        assert moved >= 2, moved
        assert _metric(url, "hetero_compute_attached", compute=computes[0]) == 0
        assert _metric(url, "hetero_compute_attached", compute=computes[1]) == 1


def _timed(stub: pb_grpc.ControlPlaneStub, prompt: list[int]) -> tuple[float, list[int]]:
    """(seconds to the first token, the tokens) of one greedy request."""
    start = time.monotonic()
    first = None
    tokens: list[int] = []
    for resp in stub.Generate(greedy(prompt, 4), timeout=300):
        for c in resp.choices:
            if c.token_ids and first is None:
                first = time.monotonic() - start
            tokens.extend(c.token_ids)
    assert first is not None
    return first, tokens


def test_shared_prefixes_meet_their_prefix_cache() -> None:
    """Requests sharing a 512-token prefix go where it is cached: the two compute planes
    compute it once each at most (their Stats count prompt tokens computed), and the
    later requests' time to first token shows the hit."""
    cport, cmetrics = free_port(), free_port()
    control = f"127.0.0.1:{cport}"
    url = f"http://127.0.0.1:{cmetrics}/metrics"
    rng = random.Random(11)
    prefix = [rng.randrange(100, 49000) for _ in range(512)]
    suffixes = [[rng.randrange(100, 49000) for _ in range(8)] for _ in range(8)]
    with (
        _computes(2) as (computes, _),
        child(_control_cmd(cport, cmetrics, ",".join(computes)), control),
        grpc.insecure_channel(control) as ch,
    ):
        stub = pb_grpc.ControlPlaneStub(ch)
        _timed(stub, [5, 6, 7])  # both planes warm
        _timed(stub, [8, 9, 10])
        before = sum(_stats(a).num_prompt_tokens_computed for a in computes)
        cold, _ = _timed(stub, prefix + suffixes[0])
        results: list[tuple[float, list[int]] | BaseException] = [ValueError()] * 7

        def run(i: int) -> None:
            try:
                results[i] = _timed(stub, prefix + suffixes[i + 1])
            except BaseException as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        timed = [r for r in results if not isinstance(r, BaseException)]
        assert len(timed) == 7, results
        computed = sum(_stats(a).num_prompt_tokens_computed for a in computes) - before
        # The prefix once (both planes: twice at most), then each request's own tokens and
        # the partial block before them.
        assert computed <= 2 * 512 + 8 * (8 + 16), computed
        warm = sorted(t for t, _ in timed)
        assert warm[len(warm) // 2] < cold, (cold, warm)
        hits = sum(
            _metric(url, "hetero_routed_requests_total", compute=a, reason="prefix")
            for a in computes
        )
        assert hits >= 7, hits
        # ModelInfo counts both planes: all their blocks, whole again, integrity checked.
        info = stub.ModelInfo(pb.ModelInfoRequest(detailed=True), timeout=30)
        blocks = 0
        for a in computes:
            with grpc.insecure_channel(a) as kch:
                d = cpb_grpc.ComputePlaneStub(kch).Describe(cpb.DescribeRequest(), timeout=30)
                blocks += d.num_kv_blocks
        assert info.num_kv_blocks == blocks
        st = info.stats
        assert st.integrity_ok, st.integrity_error
        assert st.num_free_kv_blocks == st.num_usable_kv_blocks and st.num_running == 0


def test_compute_planes_join_and_leave_a_running_stack(tmp_path: Path) -> None:
    """The control plane reads its compute planes from a file: a plane added there gets
    new requests within seconds; a plane removed hands its running requests to the other
    (none lost, texts unchanged)."""
    cport, cmetrics = free_port(), free_port()
    control = f"127.0.0.1:{cport}"
    listing = tmp_path / "compute.txt"
    with _computes(2) as (computes, _):
        listing.write_text(computes[0] + "\n")
        cmd = _control_cmd(cport, cmetrics, f"file:{listing}", "--compute-resolve-interval", "0.3")
        with child(cmd, control), grpc.insecure_channel(control) as ch:
            stub = pb_grpc.ControlPlaneStub(ch)
            expected = _Streams(stub, _prompts()).join()  # the 8 at once, on one plane
            assert _stats(computes[1]).num_requests_added == 0

            # A plane joins: within seconds a new request lands on it.
            streams = _Streams(stub, _prompts()[:4])
            streams.wait_tokens(3)
            listing.write_text(f"{computes[0]}\n{computes[1]}  # added\n")
            deadline = time.monotonic() + 20
            while _stats(computes[1]).num_requests_added == 0:
                assert time.monotonic() < deadline, "the new compute plane got no request"
                generate(stub, greedy([11, 12, 13], 2))
            later = _Streams(stub, _prompts()[4:])
            later.wait_tokens(3)
            first = streams.join() + later.join()
            assert first == expected

            # A plane leaves (gone from the file) while streams run on both.
            long = _Streams(stub, _prompts(), max_tokens=LONG_TOKENS).join()  # reference
            streams = _Streams(stub, _prompts(), max_tokens=LONG_TOKENS)
            streams.wait_tokens(5)
            held = [_stats(a).num_active_requests for a in computes]
            assert held[0] >= 1 and held[1] >= 1, held
            listing.write_text(computes[1] + "\n")
            assert streams.join() == long
            url = f"http://127.0.0.1:{cmetrics}/metrics"
            moved = _metric(url, "hetero_routed_requests_total", reason="moved")
            assert moved >= 1, moved
            # Its series go with it (with discovery, pods come back under new addresses).
            label = f'compute="{computes[0]}"'
            deadline = time.monotonic() + 10
            while label in (text := httpx.get(url, timeout=10).text):
                assert time.monotonic() < deadline, [ln for ln in text.splitlines() if label in ln]
                time.sleep(0.2)
            assert f'compute="{computes[1]}"' in text


def test_a_draining_compute_plane_hands_over_its_waiting_requests() -> None:
    """SIGTERM one of two compute planes (each runs 2 requests at a time, so others wait):
    it finishes its running requests, its waiting ones move to the other plane at once,
    and it exits long before its drain timeout; every text equals the uninterrupted run's."""
    cport, cmetrics = free_port(), free_port()
    control = f"127.0.0.1:{cport}"
    url = f"http://127.0.0.1:{cmetrics}/metrics"
    ports = [free_port() for _ in range(2)]
    computes = [f"127.0.0.1:{p}" for p in ports]
    cmd = _control_cmd(cport, cmetrics, ",".join(computes), "--max-num-seqs", "2")
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(child([*_compute_cmd(p), "--drain-timeout", "120"], a))
            for p, a in zip(ports, computes, strict=True)
        ]
        stack.enter_context(child(cmd, control))
        stub = pb_grpc.ControlPlaneStub(stack.enter_context(grpc.insecure_channel(control)))
        expected = _Streams(stub, _prompts()).join()
        streams = _Streams(stub, _prompts())
        deadline = time.monotonic() + 120
        while sum(len(g) >= 5 for g in streams.got) < 2:
            assert time.monotonic() < deadline and not streams.errors, streams.errors
            time.sleep(0.01)
        assert sum(not g for g in streams.got) >= 2  # some wait
        procs[0].send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert streams.join() == expected
        procs[0].wait(timeout=60)
        assert time.monotonic() - signalled < 60  # its drain timeout is 120 s
        moved = _metric(url, "hetero_routed_requests_total", compute=computes[1], reason="moved")
        assert moved >= 1, moved


def _free_pair() -> int:
    """A free port whose next one is free too."""
    while True:
        port = free_port()
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port


def test_serve_starts_several_compute_planes(tmp_path: Path) -> None:
    """`hetero-infer serve --compute-planes 2`: two compute planes behind the control
    plane, both attached, concurrent requests spread over both; their /metrics on
    consecutive ports from --compute-metrics-port, each logged with its gRPC address."""
    port, cmetrics, kmetrics = free_port(), free_port(), _free_pair()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hetero_infer.cli", "serve", "--port", str(port)]
    cmd += ["--compute-planes", "2", "--control-metrics-port", str(cmetrics)]
    cmd += ["--compute-metrics-port", str(kmetrics)]
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stderr=err, start_new_session=True)
    try:
        wait_http_ready(url + "/ready", proc, timeout=300)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a", "Dear Sir,"]
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda p: httpx.post(
                        url + "/v1/completions", json={**body, "prompt": p}, timeout=120
                    ),
                    prompts,
                )
            )
        for r in answers:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 24
        lines = httpx.get(f"http://127.0.0.1:{cmetrics}/metrics", timeout=10).text.splitlines()
        attached = [ln for ln in lines if ln.startswith("hetero_compute_attached{")]
        assert len(attached) == 2 and all(ln.endswith(" 1.0") for ln in attached), attached
        routed = [ln for ln in lines if ln.startswith("hetero_routed_requests_total{")]
        computes = {ln.split('compute="')[1].split('"')[0] for ln in routed}
        assert len(computes) == 2, routed
        # The first plane had --compute-metrics-port, the other a free port, logged
        # without its plane's address: nothing told which plane's series were whose.
        logged = dict(
            re.findall(
                r"metrics at http://127\.0\.0\.1:(\d+)/metrics \(gRPC on (\S+)\)", log.read_text()
            )
        )
        assert set(logged) >= {str(kmetrics), str(kmetrics + 1)}, log.read_text()
        assert {logged[str(kmetrics)], logged[str(kmetrics + 1)]} == computes, logged
        for metrics in (kmetrics, kmetrics + 1):
            text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
            assert "hetero_compute_steps_total" in text
    finally:
        with contextlib.suppress(ProcessLookupError):  # serve may have exited already
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0  # serve stops every plane cleanly
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def test_a_compute_plane_serving_another_model_is_refused_and_left_free(tmp_path: Path) -> None:
    """Two compute planes serving different models behind one control plane: the one met
    second is not attached, one ERROR line names both models, and it is left free (no step
    stream open), so a control plane of its own model drives it. The refusal was never
    logged, and each try (every 2 s) opened a step stream, so the plane stayed taken: a
    second control plane was refused it for ever."""
    cport, cmetrics, cport2, cmetrics2 = (free_port() for _ in range(4))
    control = f"127.0.0.1:{cport}"
    smol_port, gemma_port = free_port(), free_port()
    smol, gemma = f"127.0.0.1:{smol_port}", f"127.0.0.1:{gemma_port}"
    log = tmp_path / "control.log"
    with contextlib.ExitStack() as stack:
        stack.enter_context(child(_compute_cmd(smol_port), smol))
        proc = _logged_control(stack, log, cport, cmetrics, f"{smol},{gemma}")
        wait_serving(control, proc)
        # (started after the control plane attached SmolLM2: met second)
        stack.enter_context(child([*_compute_cmd(gemma_port), "--model", "gemma3"], gemma))
        errors = _refused(log, " ERROR ", stack, cport2, cmetrics2, gemma)
        assert len(errors) == 1, errors
        assert f"compute plane {gemma} not attached: " in errors[0], errors[0]
        assert "serves Gemma 3 270m (vocabulary 262144), not Smollm2" in errors[0], errors[0]
        assert f"as compute plane {smol} does" in errors[0], errors[0]
        url = f"http://127.0.0.1:{cmetrics}/metrics"
        assert _metric(url, "hetero_compute_attached", compute=smol) == 1
        assert _metric(url, "hetero_compute_attached", compute=gemma) == 0
        with grpc.insecure_channel(control) as ch:  # the first control plane still serves
            assert generate(pb_grpc.ControlPlaneStub(ch), greedy([11, 12, 13], 2)).tokens[0]


def _logged_control(
    stack: contextlib.ExitStack, log: Path, port: int, metrics_port: int, compute: str, *extra: str
) -> subprocess.Popen[bytes]:
    """A control plane whose log goes to `log`, stopped with `stack` (waiting for it to
    serve is the caller's: some wait for it not to)."""
    cmd = [
        sys.executable,
        "-m",
        "hetero_infer.cli",
        *_control_cmd(port, metrics_port, compute, *extra),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=stack.enter_context(log.open("wb"))
    )
    stack.callback(stop_process, proc)
    return proc


def _refused(
    log: Path, needle: str, stack: contextlib.ExitStack, port: int, metrics_port: int, compute: str
) -> list[str]:
    """The lines of a control plane's `log` with `needle`, once it logged refusing
    `compute` and a Gemma 3 control plane on `port` then attached that compute plane: it
    was left free (its step stream not held)."""
    deadline = time.monotonic() + 60
    while needle not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    cmd = _control_cmd(port, metrics_port, compute, "--model", "gemma3")
    stack.enter_context(child(cmd, f"127.0.0.1:{port}"))
    url, deadline = f"http://127.0.0.1:{metrics_port}/metrics", time.monotonic() + 30
    while _metric(url, "hetero_compute_attached", compute=compute) != 1:
        assert time.monotonic() < deadline, "the refused compute plane was not left free"
        time.sleep(0.2)
    return [line for line in log.read_text().splitlines() if needle in line]


def test_a_compute_plane_restarted_with_another_model_is_refused_and_left_free(
    tmp_path: Path, hf_smollm2_tokenizer: object
) -> None:
    """A control plane tokenises for its own --model and a compute plane must serve a model
    of that vocabulary. Here the control plane's tokenizer is the bundled model's in HF
    form (a tokenizer.json) and its compute plane serves the GGUF: the same model, another
    name, attached. The compute plane then comes back at its address serving Gemma 3 (a
    rollout that upgraded the compute pods first): not attached, one ERROR line, and left
    free for a Gemma 3 control plane. It was attached and fed SmolLM2's token ids to
    Gemma's weights: gibberish, silently."""
    folder = tmp_path / "smollm2-hf"
    hf_smollm2_tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    cport, cmetrics, cport2, cmetrics2, kport = (free_port() for _ in range(5))
    control, compute = f"127.0.0.1:{cport}", f"127.0.0.1:{kport}"
    log = tmp_path / "control.log"
    url = f"http://127.0.0.1:{cmetrics}/metrics"
    with contextlib.ExitStack() as stack:
        with child(_compute_cmd(kport), compute):
            proc = _logged_control(stack, log, cport, cmetrics, compute, "--model", str(folder))
            wait_serving(control, proc)
            with grpc.insecure_channel(control) as ch:
                assert generate(pb_grpc.ControlPlaneStub(ch), greedy([11, 12, 13], 2)).tokens[0]
        stack.enter_context(child([*_compute_cmd(kport), "--model", "gemma3"], compute))
        errors = _refused(log, " not attached: ", stack, cport2, cmetrics2, compute)
        assert len(errors) == 1, errors  # (tried every 2 s, logged once)
        assert " ERROR " in errors[0], errors[0]
        assert errors[0].endswith(
            f"compute plane {compute} not attached: --model {folder}: the compute plane at "
            f"{compute} serves Gemma 3 270m, whose vocabulary is not this tokenizer's (0 of 48 "
            "blocks of 1024 token ids agree)"
        ), errors[0]
        assert _metric(url, "hetero_compute_attached", compute=compute) == 0


def _log_has(log: Path, needle: str, timeout: float = 60) -> str:
    """The first line of `log` with `needle`, once there."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in log.read_text().splitlines() if needle in line]
        if found:
            return found[0]
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def _wait_attached(url: str, compute: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _metric(url, "hetero_compute_attached", compute=compute) != 1:
        assert time.monotonic() < deadline, f"compute plane {compute} was not attached"
        time.sleep(0.2)


def test_an_unfit_compute_plane_met_first_does_not_stop_the_start_up(tmp_path: Path) -> None:
    """Of the compute planes listed, the one met first serves another model (Gemma 3) and
    the one of this model comes up later: the control plane logs the refusal and serves
    with the other. It exited at the first refusal (exit 2), although which plane answers
    first is a race."""
    cport, cmetrics, gemma_port, smol_port = (free_port() for _ in range(4))
    control = f"127.0.0.1:{cport}"
    gemma, smol = f"127.0.0.1:{gemma_port}", f"127.0.0.1:{smol_port}"
    log = tmp_path / "control.log"
    with contextlib.ExitStack() as stack:
        stack.enter_context(child([*_compute_cmd(gemma_port), "--model", "gemma3"], gemma))
        proc = _logged_control(stack, log, cport, cmetrics, f"{gemma},{smol}")
        refusal = _log_has(log, " not attached: ")
        assert f"compute plane {gemma} not attached: " in refusal, refusal
        time.sleep(1.0)  # (it exited within a few ms of that line)
        assert proc.poll() is None, log.read_text()
        url = f"http://127.0.0.1:{cmetrics}/metrics"
        # Refused as of another vocabulary than this control plane's tokenizer, and only so
        # (read before the other plane attaches: tried again beside it, the Gemma plane is
        # refused for differing from it first, its shape).
        assert _metric(url, "hetero_compute_unfit", compute=gemma, reason="tokenizer") == 1
        assert _metric(url, "hetero_compute_unfit", compute=gemma, reason="shape") == 0
        stack.enter_context(child(_compute_cmd(smol_port), smol))
        wait_serving(control, proc)
        with grpc.insecure_channel(control) as ch:
            assert generate(pb_grpc.ControlPlaneStub(ch), greedy([11, 12, 13], 2)).tokens[0]
        assert _metric(url, "hetero_compute_attached", compute=gemma) == 0
        assert _metric(url, "hetero_compute_unfit", compute=smol, reason="tokenizer") == 0


def test_the_same_model_in_another_form_attaches_beside_it_another_size_does_not(
    tmp_path: Path, hf_smollm2: object, hf_smollm2_tokenizer: object
) -> None:
    """A GPU pod with the model's HF safetensors beside a CPU pod with its GGUF is the
    deployment this project is for: the two compute planes report different model names
    (the GGUF's general.name, the folder's name) and the second was refused as serving
    another model. Now what must agree is compared: the vocabulary and the model's shape.
    A model of the same tokenizer and another size (a random 2-layer Llama with the bundled
    model's tokenizer.json) is still refused, naming what differs."""
    from safetensors.torch import save_file

    from tests.conftest import make_tiny_model

    same = tmp_path / "smollm2-hf"  # (transformers' GGUF dequantisation, in HF form)
    same.mkdir()
    config = hf_smollm2.config.to_dict()  # type: ignore[attr-defined]
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_smollm2).__name__]  # (None when read from a GGUF)
    (same / "config.json").write_text(json.dumps(config))
    weights = {  # (the tied head is the embedding, as HF checkpoints leave it out)
        k: v.contiguous()
        for k, v in hf_smollm2.state_dict().items()  # type: ignore[attr-defined]
        if k != "lm_head.weight"
    }
    save_file(weights, str(same / "model.safetensors"))
    hf_smollm2_tokenizer.save_pretrained(same)  # type: ignore[attr-defined]
    other = tmp_path / "tiny-same-vocab"
    make_tiny_model("llama", other, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    hf_smollm2_tokenizer.save_pretrained(other)  # type: ignore[attr-defined]
    cport, cmetrics, gport, hport, tport = (free_port() for _ in range(5))
    control = f"127.0.0.1:{cport}"
    gguf, hf, tiny = (f"127.0.0.1:{p}" for p in (gport, hport, tport))
    log = tmp_path / "control.log"
    url = f"http://127.0.0.1:{cmetrics}/metrics"
    with contextlib.ExitStack() as stack:
        stack.enter_context(child(_compute_cmd(gport), gguf))
        proc = _logged_control(stack, log, cport, cmetrics, f"{gguf},{hf},{tiny}")
        wait_serving(control, proc)  # (the GGUF's plane, the only one up)
        stack.enter_context(child([*_compute_cmd(hport), "--model", str(same)], hf))
        _wait_attached(url, hf)
        stack.enter_context(child([*_compute_cmd(tport), "--model", str(other)], tiny))
        refusal = _log_has(log, f"compute plane {tiny} not attached: ")
        assert " ERROR " in refusal, refusal
        assert f"serves {other.name} (layers 2), not " in refusal, refusal
        assert f"(layers 30) as compute plane {gguf} does" in refusal, refusal
        assert _metric(url, "hetero_compute_attached", compute=gguf) == 1
        assert _metric(url, "hetero_compute_attached", compute=hf) == 1
        assert _metric(url, "hetero_compute_attached", compute=tiny) == 0
        assert _metric(url, "hetero_compute_unfit", compute=tiny, reason="shape") == 1
        assert _metric(url, "hetero_compute_unfit", compute=tiny, reason="weights") == 0
        assert _metric(url, "hetero_compute_unfit", compute=hf, reason="shape") == 0
        # Both serve: enough requests at once that each plane takes some.
        with grpc.insecure_channel(control) as ch, ThreadPoolExecutor(8) as pool:
            stub = pb_grpc.ControlPlaneStub(ch)
            outs = list(pool.map(lambda p: generate(stub, greedy(p, 4)), _prompts()[:8]))
        assert all(len(o.tokens[0]) == 4 for o in outs)
        assert _stats(hf).num_sampled_tokens > 0 and _stats(gguf).num_sampled_tokens > 0


def test_a_compute_plane_with_other_weights_of_the_same_shape_is_refused(
    tmp_path: Path, hf_smollm2_tokenizer: object
) -> None:
    """Two fine-tunes of one model (here two random 2-layer Llamas of the same shape and
    tokenizer) behind one control plane: the same folder twice attaches twice, the other
    weights are refused (one ERROR line naming the tensor that differs) and left free for
    a control plane of their own. They were attached, and a request's steps, or a request
    moved off a failed plane, went on under other weights: other output, silently."""
    from tests.conftest import make_tiny_model

    tuned, other = tmp_path / "tuned", tmp_path / "other"
    for folder, seed in ((tuned, 0), (other, 1)):
        make_tiny_model("llama", folder, seed=seed, vocab_size=49152)
        hf_smollm2_tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    cport, cmetrics, cport2, cmetrics2, aport, a2port, bport = (free_port() for _ in range(7))
    control = f"127.0.0.1:{cport}"
    a, a2, b = (f"127.0.0.1:{p}" for p in (aport, a2port, bport))
    log = tmp_path / "control.log"
    url = f"http://127.0.0.1:{cmetrics}/metrics"
    with contextlib.ExitStack() as stack:
        stack.enter_context(child([*_compute_cmd(aport), "--model", str(tuned)], a))
        proc = _logged_control(stack, log, cport, cmetrics, f"{a},{a2},{b}", "--model", str(tuned))
        wait_serving(control, proc)
        stack.enter_context(child([*_compute_cmd(a2port), "--model", str(tuned)], a2))
        _wait_attached(url, a2)
        stack.enter_context(child([*_compute_cmd(bport), "--model", str(other)], b))
        refusal = _log_has(log, f"compute plane {b} not attached: ")
        assert " ERROR " in refusal, refusal
        assert (
            f"compute plane {b} not attached: compute plane {b} serves {other.name}, whose "
            f"weights are not those of {tuned.name}, which compute plane {a} serves: "
            "model.embed_tokens.weight differs (sampled values "
        ) in refusal, refusal
        assert _metric(url, "hetero_compute_attached", compute=a) == 1
        assert _metric(url, "hetero_compute_attached", compute=a2) == 1
        assert _metric(url, "hetero_compute_attached", compute=b) == 0
        assert _metric(url, "hetero_compute_unfit", compute=b, reason="weights") == 1
        assert _metric(url, "hetero_compute_unfit", compute=b, reason="shape") == 0
        with grpc.insecure_channel(control) as ch:
            assert len(generate(pb_grpc.ControlPlaneStub(ch), greedy([11, 12, 13], 2)).tokens[0])
        # Left free: a control plane of the other weights drives it.
        cmd = _control_cmd(cport2, cmetrics2, b, "--model", str(other))
        stack.enter_context(child(cmd, f"127.0.0.1:{cport2}"))
        _wait_attached(f"http://127.0.0.1:{cmetrics2}/metrics", b, timeout=30)
        assert len([line for line in log.read_text().splitlines() if " ERROR " in line]) == 1


def test_an_unfit_compute_plane_leaves_its_place_under_max_compute_planes(
    tmp_path: Path,
) -> None:
    """With --max-compute-planes 1 and the first compute plane listed serving another
    model, the control plane passes it over (as one another control plane drives) and
    attaches the next one listed. The unfit one held the only place: the control plane
    exited at start-up, or, once serving, never drove a plane again."""
    cport, cmetrics, gemma_port, smol_port = (free_port() for _ in range(4))
    control = f"127.0.0.1:{cport}"
    gemma, smol = f"127.0.0.1:{gemma_port}", f"127.0.0.1:{smol_port}"
    listing = tmp_path / "compute.txt"
    listing.write_text(f"{gemma}\n{smol}\n")
    log = tmp_path / "control.log"
    with contextlib.ExitStack() as stack:
        stack.enter_context(child([*_compute_cmd(gemma_port), "--model", "gemma3"], gemma))
        stack.enter_context(child(_compute_cmd(smol_port), smol))
        proc = _logged_control(
            stack,
            log,
            cport,
            cmetrics,
            f"file:{listing}",
            "--compute-resolve-interval",
            "0.3",
            "--max-compute-planes",
            "1",
        )
        wait_serving(control, proc)
        url = f"http://127.0.0.1:{cmetrics}/metrics"
        assert _metric(url, "hetero_compute_attached", compute=smol) == 1
        assert f"compute plane {gemma} not attached: " in log.read_text()
        with grpc.insecure_channel(control) as ch:
            assert generate(pb_grpc.ControlPlaneStub(ch), greedy([11, 12, 13], 2)).tokens[0]
