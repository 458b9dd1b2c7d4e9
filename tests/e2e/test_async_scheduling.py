"""Async scheduling through the gateway (three processes, the official `openai` client): with
`--async-scheduling` the control plane plans and sends each step before the previous one's
result arrives. Greedy text equals that without it, byte for byte, over 40 prompts with stop
strings, max_tokens cut-offs and logprobs in a KV pool small enough to preempt; and with the
compute plane killed mid-stream (tests/e2e/test_failover.py runs both ways)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hetero_infer.local import free_port
from tests.e2e.test_speculative import _run, _same
from tests.procs import compute_plane

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compute() -> Iterator[str]:
    with compute_plane("--kv-cache-bytes", str(96 << 20)) as address:
        yield address


def _steps(metrics_port: int) -> dict[str, float]:
    """hetero_steps_total by planned_ahead, from the control plane's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("hetero_steps_total{"):
            key = "ahead" if 'planned_ahead="true"' in line else "sync"
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def test_greedy_text_with_async_scheduling_equals_without(compute: str) -> None:
    plain, plain_stats = _run(compute)
    assert plain_stats.num_preemptions > 0, "the pool was not small enough to preempt"
    assert {r[1] for r in plain} == {"stop", "length"}
    port = free_port()
    seen: dict[str, Any] = {}

    def scrape() -> None:
        seen.update(_steps(port))

    got, stats = _run(compute, "--async-scheduling", "--metrics-port", str(port), on_done=scrape)
    _same(got, plain)
    assert stats.num_preemptions > 0
    # Most steps were planned while the previous one ran.
    assert seen["ahead"] > seen["sync"] > 0, seen
