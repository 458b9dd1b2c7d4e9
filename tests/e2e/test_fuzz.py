"""Property-based fuzzing of the gateway from its own OpenAPI schema (schemathesis + hypothesis).

Valid and invalid bodies for every POST route, most of them naming the served model so
that they reach tokenisation, scheduling and sampling: no 5xx, no crash, and the stack
answers a normal request afterwards with its KV pool whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc
from tests.procs import FullStack, gateway_stack

pytestmark = pytest.mark.slow

CASES_PER_ROUTE = 500  # 2 POST routes: >= 1,000 cases in all
MAX_MODEL_LEN = 20  # keeps every valid request short (<= 19 new tokens), so the cases run quickly


@pytest.fixture(scope="module", params=["sync", "async"])
def stack(request: pytest.FixtureRequest) -> Iterator[FullStack]:
    """Both ways of planning steps: with --async-scheduling a step is planned while the one
    before it runs (the tokens it samples for ended requests dropped)."""
    control = ("--max-model-len", str(MAX_MODEL_LEN))
    control += ("--async-scheduling",) if request.param == "async" else ("--no-async-scheduling",)
    with gateway_stack(("--kv-cache-bytes", str(64 << 20)), control) as s:
        yield s


@pytest.fixture(scope="module")
def model(stack: FullStack) -> str:
    return str(httpx.get(stack.url + "/v1/models").json()["data"][0]["id"])


@dataclass
class _Case:
    body: dict[str, Any]


def _common_requests(route: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies with the input and a few sampling fields, in and out of their ranges."""
    text = st.text(max_size=30)
    if route == "/v1/completions":
        required: dict[str, Any] = {
            "prompt": st.one_of(text, st.lists(st.integers(0, 60000), max_size=8))
        }
    else:
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": text}
        )
        required = {"messages": st.lists(message, min_size=1, max_size=3)}
    return st.fixed_dictionaries(
        required,
        optional={
            "max_tokens": st.integers(-1, 30),
            "temperature": st.floats(-0.5, 2.5),
            "top_p": st.floats(0, 1.2),
            "seed": st.integers(0, 2**64),
            "stop": st.lists(text, max_size=3),
            "stream": st.booleans(),
            "n": st.integers(0, 3),
            "logprobs": st.booleans(),
        },
    )


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_requests_never_5xx(stack: FullStack, model: str, route: str) -> None:
    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    operation = schema[route]["POST"]
    cases = st.one_of(
        operation.as_strategy(schemathesis.GenerationMode.POSITIVE),
        operation.as_strategy(schemathesis.GenerationMode.NEGATIVE),
        # The schema's optional fields are many, and random values of them are rarely
        # valid together: requests of the common fields alone make sure some run.
        _common_requests(route).map(_Case),
    )
    seen: dict[int, int] = {}
    http = httpx.Client(base_url=stack.url, timeout=60)

    @settings(
        max_examples=CASES_PER_ROUTE,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, use_model=st.sampled_from([True, True, True, False]))
    def check(case: Any, use_model: bool) -> None:
        body = case.body
        if use_model and isinstance(body, dict):
            body = {**body, "model": model}
        if isinstance(body, (dict, list, str, int, float, bool)) or body is None:
            r = http.post(route, json=body)
        else:
            r = http.post(route, content=bytes(body))
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.status_code, r.text[:500])
        if r.status_code >= 400 and not r.headers.get("content-type", "").startswith("text/"):
            assert set(r.json()["error"]) >= {"message", "type"}, r.text[:500]

    check()
    http.close()
    print(route, dict(sorted(seen.items())))
    assert sum(seen.values()) >= CASES_PER_ROUTE
    assert seen.get(200, 0) > 0, seen  # some cases were valid and ran on the model
    # The stack still serves, and nothing is left holding KV blocks.
    ok = httpx.post(
        stack.url + "/v1/completions",
        json={"model": model, "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    with grpc.insecure_channel(stack.control) as ch:
        stats = pb_grpc.ControlPlaneStub(ch).ModelInfo(pb.ModelInfoRequest(detailed=True)).stats
    assert stats.num_free_kv_blocks == stats.num_usable_kv_blocks, stats
    assert stats.integrity_ok, stats.integrity_error
