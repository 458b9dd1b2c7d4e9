"""Async scheduling through the gateway (three processes, the official `openai` client): with
`--async-scheduling` the control plane plans and sends each step before the previous one's
result arrives. Greedy text equals that without it, byte for byte, over 40 prompts with stop
strings, max_tokens cut-offs and logprobs in a KV pool small enough to preempt, also with the
compute plane launching each step before the previous one finished (`--overlap-steps on`,
the default on CUDA) and two steps planned ahead (`--steps-ahead 2`, the default on CUDA);
and with the compute plane killed mid-stream (tests/e2e/test_failover.py runs both ways).
The compute plane makes its engine calls on its event loop, as on CUDA by default
(`--engine-thread off`), except where its steps overlap (on a CPU they overlap only when
the calls run on the worker thread)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hetero_infer.local import free_port
from hetero_proto import control_pb2 as pb
from tests.e2e.test_speculative import MAX_BLOCKS, _run, _same
from tests.procs import compute_plane, gateway_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compute() -> Iterator[str]:
    # The engine's calls on the server's event loop, as on CUDA by default (on a CPU its
    # steps then never overlap: the loop reads the next step only once a launch returned).
    args = ("--kv-cache-bytes", str(96 << 20), "--engine-thread", "off")
    with compute_plane(*args) as address:
        yield address


def _steps(
    metrics_port: int, name: str = "hetero_steps_total", label: str = "planned_ahead"
) -> dict[str, float]:
    """A step counter by its true/false label ("ahead"/"sync"), from a plane's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            key = "ahead" if f'{label}="true"' in line else "sync"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _computed(metrics_port: int) -> float:
    """Tokens a compute plane has computed (its tokens-per-step histogram's sum)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    name = "hetero_compute_tokens_per_step_sum"
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


@pytest.fixture(scope="module")
def sequential(compute: str) -> tuple[list[Any], pb.EngineStats]:
    """The 40 prompts without async scheduling."""
    return _run(compute)


def test_greedy_text_with_async_scheduling_equals_without(
    compute: str, sequential: tuple[list[Any], pb.EngineStats]
) -> None:
    plain, plain_stats = sequential
    assert plain_stats.num_preemptions > 0, "the pool was not small enough to preempt"
    assert {r[1] for r in plain} == {"stop", "length"}
    port = free_port()
    seen: dict[str, Any] = {}

    def scrape() -> None:
        seen.update(_steps(port))

    # Planned a step ahead, a request short of a block may wait for the step in flight to
    # end rather than preempt, and by then others may have ended: with 24 blocks a run
    # preempted 0-2 times (0 failed CI once); with half the blocks it preempts every run.
    async_args = ("--async-scheduling", "--metrics-port", str(port))
    got, stats = _run(compute, *async_args, on_done=scrape, max_blocks=MAX_BLOCKS // 2)
    _same(got, plain)
    assert stats.num_preemptions > 0
    # Most steps were planned while the previous one ran.
    assert seen["ahead"] > seen["sync"] > 0, seen


def test_overlapped_compute_steps_keep_greedy_text(
    sequential: tuple[list[Any], pb.EngineStats],
) -> None:
    """The compute plane launches step k + 1 (its decode inputs the samples of step k,
    taken on the device) before it finishes step k, with two steps planned ahead, as on a
    GPU by default: the text equals the sequential run's."""
    plain = sequential[0]
    metrics_port = free_port()
    args = ("--kv-cache-bytes", str(96 << 20), "--overlap-steps", "on")
    # Two steps ahead, a request short of a block waits for a step planned with nothing in
    # flight to preempt, and by then others may have ended: the pool here has half the
    # blocks, so that it still preempts (1-2 times a run with 24 blocks, once none; 4-7
    # with 12).
    with compute_plane(*args, metrics_port=metrics_port) as overlapping:
        ahead = ("--async-scheduling", "--steps-ahead", "2")
        got, stats = _run(overlapping, *ahead, max_blocks=MAX_BLOCKS // 2)
        launched = _steps(metrics_port, "hetero_compute_steps_total", "overlapped")
    _same(got, plain)
    assert stats.num_preemptions > 0
    # Launched behind the previous step whenever it was queued in time: about half of the
    # steps here (the small pool makes many steps wait for a result to be planned).
    assert launched["ahead"] >= 0.25 * (launched["ahead"] + launched["sync"]) > 0, launched


def test_speculative_decoding_with_async_scheduling_keeps_greedy_text(
    compute: str, sequential: tuple[list[Any], pb.EngineStats]
) -> None:
    """With proposals, steps are planned one at a time and applied with their accepted
    tokens (they were once resolved as planned-ahead steps, which dropped them)."""
    got, stats = _run(compute, "--async-scheduling", "--speculative", "ngram")
    _same(got, sequential[0])
    assert stats.num_spec_accepted_tokens > 0


def test_n_choices_compute_the_prompt_once_when_the_first_token_ends_them() -> None:
    """n > 1 planned ahead: the compute plane computes the prompt once (the other choices
    fork the first's blocks, recomputing only its partly filled last block), also when the
    token sampled with the prompt ends the choice (max_tokens 1; a prompt-only scoring
    request: echo with max_tokens 0). The first choice was freed before its blocks were
    handed on, so each choice computed the whole prompt. The choices' texts agree."""
    prompt = "Count the ways: " + " ".join(f"item {i} is {i * 7 % 13}" for i in range(30))
    with gateway_stack(control_args=("--async-scheduling",)) as stack:
        model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for extra in (
            {"max_tokens": 1, "temperature": 0},
            {"max_tokens": 0, "echo": True, "logprobs": 1},
        ):
            before = _computed(stack.compute_metrics)
            body = {"model": model, "prompt": prompt, "n": 3, **extra}
            r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            computed = _computed(stack.compute_metrics) - before
            num_prompt = r.json()["usage"]["prompt_tokens"]
            assert num_prompt > 100
            # The prompt once, 2 tails of under a block (16) each, nothing else sampled.
            assert num_prompt < computed < num_prompt + 2 * 16, (extra, computed, num_prompt)
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1, 2]
            assert len({c["text"] for c in choices}) == 1, choices
