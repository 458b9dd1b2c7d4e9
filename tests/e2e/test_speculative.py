"""Speculative decoding through the gateway (three processes, the official `openai` client):
greedy text with n-gram or draft-model proposals, k = 1..5, is byte for byte the text without
them, over 40 prompts with stop strings, max_tokens cut-offs and logprobs, in a KV pool small
enough that requests are preempted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest

from hetero_infer.local import free_port
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.procs import compute_plane, control_gateway

pytestmark = pytest.mark.slow

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Paris is the capital of France and is known for the Eiffel Tower.",
    "Water boils at 100 degrees Celsius at sea level.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)",
    "The meeting is on Monday at 10 am in room 4B with the whole team.",
    "Alice sent Bob a letter, and Bob sent Alice a parcel in return.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
]
ASKS = [
    "Repeat this text exactly: {}",
    "Copy the following, changing nothing:\n{}",
    "Summarize in one sentence: {}",
    "Fix any mistakes in this and write it out again: {}",
    "What is this about? {}",
]
PROMPTS = [ask.format(text) for text in TEXTS for ask in ASKS]
MAX_BLOCKS = 24  # of 16 tokens: 8 concurrent requests of up to ~95 tokens do not all fit


def _params(i: int) -> dict[str, Any]:
    p: dict[str, Any] = {"temperature": 0, "max_tokens": (8, 16, 24, 32)[i % 4]}
    if i % 5 == 1:
        p["stop"] = ["."]
    elif i % 5 == 3:
        p["stop"] = ["\n", "is"]
    if i % 3 == 0:
        p.update(logprobs=True, top_logprobs=2)
    return p


@pytest.fixture(scope="module")
def compute() -> Iterator[str]:
    # Holds a draft model (the bundled model drafting for itself); n-gram proposals and
    # no proposals at all run on it too.
    args = ("--draft-model", "default", "--max-speculative-tokens", "5")
    with compute_plane(*args, "--kv-cache-bytes", str(96 << 20)) as address:
        yield address


def _run(
    compute: str,
    *control_args: str,
    on_done: Callable[[], object] | None = None,
    max_blocks: int = MAX_BLOCKS,
) -> tuple[list[Any], pb.EngineStats]:
    """The 40 prompts, 8 at a time, through a control plane (with `control_args` and a pool
    of `max_blocks`) and a gateway on `compute`; `on_done` runs while the stack is still up."""
    port = free_port()
    control = f"127.0.0.1:{port}"
    args = ["control-plane", "--port", str(port), "--compute", compute, "--metrics-port", "-1"]
    args += ["--max-num-blocks", str(max_blocks), *control_args]
    with control_gateway(args, control) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        model = client.models.list().data[0].id

        def one(i: int) -> Any:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPTS[i]}], **_params(i)
            )
            c = r.choices[0]
            lps = None
            if c.logprobs is not None and c.logprobs.content is not None:
                lps = [
                    (t.token, t.logprob, [x.token for x in t.top_logprobs])
                    for t in c.logprobs.content
                ]
            return c.message.content, c.finish_reason, r.usage.completion_tokens, lps

        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(one, range(len(PROMPTS))))
        with grpc.insecure_channel(control) as ch:
            info = pb_grpc.ControlPlaneStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        if on_done is not None:
            on_done()
        return results, info.stats


@pytest.fixture(scope="module")
def plain(compute: str) -> list[Any]:
    results, stats = _run(compute)
    assert stats.num_preemptions > 0, "the pool was not small enough to preempt"
    assert stats.num_spec_drafts == 0
    finish = {r[1] for r in results}
    assert finish == {"stop", "length"}, finish
    return results


def _same(got: list[Any], want: list[Any]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[:3] == w[:3], (i, PROMPTS[i], g[:3], w[:3])
        if w[3] is not None:
            assert [(t, top) for t, _, top in g[3]] == [(t, top) for t, _, top in w[3]], i
            for (_, a, _), (_, b, _) in zip(g[3], w[3], strict=True):
                assert abs(a - b) < 2e-3, (i, a, b)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_text_with_speculation_equals_without(
    compute: str, plain: list[Any], method: str
) -> None:
    preempted = 0
    for k in range(1, 6):
        results, stats = _run(
            compute,
            *("--speculative", method, "--num-speculative-tokens", str(k)),
            *("--speculative-max-batch", "64", "--no-speculative-adaptive"),
        )
        _same(results, plain)
        assert stats.num_spec_drafts > 0 and stats.num_spec_accepted_tokens > 0, (k, stats)
        assert stats.num_spec_draft_tokens <= k * stats.num_spec_drafts
        preempted += stats.num_preemptions
        if method == "draft":  # the model drafting for itself is always right
            assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens, (k, stats)
    assert preempted > 0
