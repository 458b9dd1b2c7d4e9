"""kill -9 one of two control planes while eight greedy streams run through the gateway:
every stream goes on on the other control plane, and the official `openai` client sees
one unbroken stream each, with the text of an uninterrupted run.

Real processes on loopback: two compute planes, a control plane in front of each, and
one gateway with `--control a,b`. The prompts are picked so that the gateway's hash ring
(gateway.placement) puts four on each control plane, so the kill catches four mid-stream.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from gateway.generation import chat_call
from gateway.placement import HashRing, routing_key
from gateway.schemas import ChatCompletionRequest
from hetero_infer.local import free_port, stop_process, wait_serving
from hetero_proto import control_pb2 as pb
from tests.procs import gateway

pytestmark = pytest.mark.slow
MAX_TOKENS = 48
PROMPTS = [
    "The history of the city of Paris",
    "A recipe for bread:",
    "The three laws of motion are",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
    "Photosynthesis is the process",
    "My favourite season is autumn because",
    "The ocean covers most of the planet and",
    "In the morning, the baker",
    "The rules of chess are simple:",
    "A letter to my future self:",
    "Mountains are formed when",
]
QUESTIONS = [
    "What is the capital of France?",
    "Tell me a short story about a cat.",
    "Why is the sky blue?",
    "How do airplanes fly?",
    "What is a prime number?",
    "Describe a rainy day.",
    "What do bees make?",
    "Explain what a computer is.",
    "Name three fruits.",
    "How does a bicycle work?",
    "What is the moon made of?",
    "Write a haiku about winter.",
]


@dataclass
class Job:
    chat: bool
    text: str  # the prompt, or the user's question

    def key(self) -> str:
        """The gateway's routing key for this request."""
        if self.chat:
            body = {"model": "m", "messages": [{"role": "user", "content": self.text}]}
            return routing_key(chat_call(ChatCompletionRequest.model_validate(body)))
        return routing_key(pb.GenerateRequest(text=self.text))


@dataclass
class Result:
    pieces: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: Any = None
    roles: int = 0  # chat: chunks that open the message (one, in one stream)
    error: BaseException | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def pick_jobs(controls: list[str]) -> dict[str, list[Job]]:
    """Two completions and two chats on each control plane, by the gateway's ring."""
    ring = HashRing(controls)
    by_plane: dict[str, list[Job]] = {c: [] for c in controls}
    for chat, texts in ((False, PROMPTS), (True, QUESTIONS)):
        # The ring depends on the planes' (random) ports and may give one plane a small
        # share: past the list, numbered variants of its texts until each plane has two.
        variants = (f"{t} (take {i})" if i else t for i in range(20) for t in texts)
        for text in variants:
            job = Job(chat, text)
            jobs = by_plane[next(ring.walk(job.key()))]
            if sum(j.chat == chat for j in jobs) < 2:
                jobs.append(job)
            if all(sum(j.chat == chat for j in js) == 2 for js in by_plane.values()):
                break
    assert all(len(jobs) == 4 for jobs in by_plane.values()), "pick more prompts"
    return by_plane


def run_job(client: openai.OpenAI, model: str, job: Job, out: Result) -> None:
    common: dict[str, Any] = dict(
        model=model,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},  # every stream runs to MAX_TOKENS
    )
    try:
        if job.chat:
            messages: Any = [{"role": "user", "content": job.text}]
            for chunk in client.chat.completions.create(messages=messages, **common):
                if chunk.usage is not None:
                    out.usage = chunk.usage
                for c in chunk.choices:
                    out.roles += c.delta.role is not None
                    out.pieces.append(c.delta.content or "")
                    out.finish = c.finish_reason or out.finish
        else:
            # Penalties count output tokens only: the continuation carries the delivered
            # ones as resumed output (num_resumed_output_tokens), not as prompt.
            penalties = {"frequency_penalty": 0.6, "presence_penalty": 0.4}
            for chunk in client.completions.create(prompt=job.text, **common, **penalties):
                if chunk.usage is not None:
                    out.usage = chunk.usage
                for c in chunk.choices:
                    out.pieces.append(c.text)
                    out.finish = c.finish_reason or out.finish
    except BaseException as e:
        out.error = e


def start_jobs(
    client: openai.OpenAI, model: str, jobs: list[Job]
) -> tuple[list[Result], list[threading.Thread]]:
    results = [Result() for _ in jobs]
    threads = [
        threading.Thread(target=run_job, args=(client, model, job, r))
        for job, r in zip(jobs, results, strict=True)
    ]
    for t in threads:
        t.start()
    return results, threads


@contextlib.contextmanager
def processes(specs: list[tuple[list[str], str]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`hetero-infer ARGS` for each (args, address), started together (the model loads
    in parallel), yielded once every one's gRPC health is SERVING."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for args, _ in specs:
            procs.append(subprocess.Popen([sys.executable, "-m", "hetero_infer.cli", *args]))
        for proc, (_, address) in zip(procs, specs, strict=True):
            wait_serving(address, proc)
        yield procs
    finally:
        for proc in procs:
            stop_process(proc)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the gateway's samples of `name` that carry these labels."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.partition("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_streams_survive_a_control_plane_kill() -> None:
    kports, cports = [free_port(), free_port()], [free_port(), free_port()]
    computes = [f"127.0.0.1:{p}" for p in kports]
    controls = [f"127.0.0.1:{p}" for p in cports]
    # One thread each: two compute planes share the CPU (docs/performance.md).
    flags = ["--metrics-port", "-1", "--num-threads", "1", "--kv-cache-bytes", str(64 << 20)]
    compute_specs = [
        (["compute-plane", "--port", str(p), *flags], a)
        for p, a in zip(kports, computes, strict=True)
    ]
    control_specs = [
        (["control-plane", "--port", str(p), "--metrics-port", "-1", "--compute", k], a)
        for p, k, a in zip(cports, computes, controls, strict=True)
    ]
    jobs_by_plane = pick_jobs(controls)
    jobs = [j for c in controls for j in jobs_by_plane[c]]
    victim = controls[0]
    with (
        processes(compute_specs),
        processes(control_specs) as control_procs,
        gateway(",".join(controls), free_port()) as url,
    ):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        expected, threads = start_jobs(client, model, jobs)
        for t in threads:
            t.join(timeout=300)
        assert not [r.error for r in expected if r.error], [r.error for r in expected]
        assert all(r.finish == "length" for r in expected)
        routed = {c: metric(url, "hetero_gateway_routed_total", control=c) for c in controls}
        assert routed == dict.fromkeys(controls, 4.0)  # the ring as the test computed it

        got, threads = start_jobs(client, model, jobs)
        deadline = time.monotonic() + 120
        while min(sum(bool(p) for p in r.pieces) for r in got) < 3:  # all mid-stream
            assert time.monotonic() < deadline and not any(r.error for r in got)
            time.sleep(0.01)
        in_flight = {
            c: metric(url, "hetero_gateway_control_in_flight", control=c) for c in controls
        }
        assert in_flight == dict.fromkeys(controls, 4.0), in_flight
        assert all(r.finish is None for r in got[:4])  # the victim's streams are mid-way
        control_procs[0].send_signal(signal.SIGKILL)
        control_procs[0].wait()
        for t in threads:
            t.join(timeout=300)

        assert not [r.error for r in got if r.error], [r.error for r in got]
        for job, want, have in zip(jobs, expected, got, strict=True):
            assert have.text == want.text, (job, want.text, have.text)
            assert have.finish == "length"
            assert have.usage.prompt_tokens == want.usage.prompt_tokens
            assert have.usage.completion_tokens == MAX_TOKENS
            assert have.roles == want.roles == (1 if job.chat else 0)
        failovers = metric(url, "hetero_gateway_routed_total", reason="failover")
        assert failovers == 4, failovers
        assert metric(url, "hetero_gateway_routed_total", control=victim, reason="failover") == 0
