"""The router (gateway.router) in-process, over fake control planes: a call whose plane
breaks under it goes on on another one as one stream (prompt + delivered tokens as its
input, num_resumed_output_tokens = those, usage as the original's), and what cannot be continued
exactly fails with 503. The fakes stand for the control planes' GenerateMany calls; the
unit under test is the gateway's bookkeeping."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.control_planes import ControlPlane, ControlPlanes
from gateway.errors import APIError, from_code
from gateway.generation import collect_calls
from gateway.multiplex import Broken, Sink
from gateway.router import Router
from hetero_common.accumulate import ChoiceResult
from hetero_common.logs import REQUEST_ID
from hetero_proto import control_pb2 as pb

PROMPT = [1, 2, 3]
TEXT = {100: "Hel", 101: "lo", 102: " wor", 103: "ld", 104: "!", 200: ""}  # 200: half a character


class FakeMux:
    """Records each start; the test plays the control plane through its sink."""

    def __init__(self) -> None:
        self.starts: list[tuple[list[pb.GenerateRequest], Sink]] = []
        self.request_ids: list[str | None] = []  # the HTTP request's id, as logs see it
        self.cancelled: list[str] = []

    def start(self, calls: list[pb.GenerateRequest], queue: Sink, timeout: float) -> list[str]:
        self.starts.append((list(calls), queue))
        self.request_ids.append(REQUEST_ID.get())
        return [f"r{len(self.starts)}-{i}" for i in range(len(calls))]

    def cancel(self, ids: list[str]) -> None:
        self.cancelled += ids

    async def close(self) -> None:
        return None


class FakeStub:
    """Detokenize as the control plane does it: a half character decodes to U+FFFD."""

    async def Detokenize(self, req: pb.DetokenizeRequest, timeout: float) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(
            text="".join(TEXT[t] if t != 200 else "\ufffd" for t in req.token_ids)
        )


def make_router(n: int = 2, retry_timeout: float = 5.0) -> tuple[Router, list[ControlPlane]]:
    control = ",".join(f"127.0.0.1:{port}" for port in range(1, n + 1))
    planes = ControlPlanes(
        GatewayConfig(port=8000, control=control, control_retry_timeout=retry_timeout)
    )
    planes.ensure_running = lambda: None  # type: ignore[method-assign]  # no probes
    stub = FakeStub()
    for plane in planes.planes.values():
        plane.mux = FakeMux()  # type: ignore[assignment]
        plane.open = lambda stub=stub: stub  # type: ignore[method-assign,misc]
    return Router(planes, retry_timeout), list(planes.planes.values())


def mux(plane: ControlPlane) -> FakeMux:
    assert isinstance(plane.mux, FakeMux)
    return plane.mux


async def until(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def started(plane: ControlPlane, count: int = 1) -> tuple[list[pb.GenerateRequest], Sink]:
    await until(lambda: len(mux(plane).starts) >= count)
    return mux(plane).starts[count - 1]


def admitted(ids: list[int]) -> tuple[int, pb.GenerateResponse]:
    return 0, pb.GenerateResponse(prompt_token_ids=ids)


def delta(*tokens: int, finish: int = 0, usage: pb.Usage | None = None) -> Any:
    resp = pb.GenerateResponse()
    resp.choices.add(
        token_ids=list(tokens), text="".join(TEXT[t] for t in tokens), finish_reason=finish
    )
    if usage is not None:
        resp.usage.CopyFrom(usage)
    return 0, resp


def broken() -> tuple[int, APIError]:
    return 0, Broken(503, "the model server is unavailable", type="service_unavailable")


Collected = tuple[dict[int, ChoiceResult], pb.Usage, list[list[int]]]


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def request(max_tokens: int = 5, **params: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text="Hi", params=pb.GenerationParams(max_tokens=max_tokens, min_tokens=3, **params)
    )


async def start(router: Router, call: pb.GenerateRequest) -> asyncio.Task[Collected]:
    task = asyncio.create_task(collect_calls(router, [call], 60))
    await asyncio.sleep(0)
    return task


def first_and_other(planes: list[ControlPlane]) -> tuple[ControlPlane, ControlPlane]:
    (first,) = [p for p in planes if mux(p).starts]
    (other,) = [p for p in planes if p is not first]
    return first, other


def test_a_stream_continues_on_another_plane_with_nothing_repeated_or_missing() -> None:
    async def go() -> None:
        router, planes = make_router()
        original = request(max_tokens=5, seed=7, prompt_logprobs=1)
        REQUEST_ID.set("the-http-request")
        task = await start(router, original)
        first, other = first_and_other(planes)
        _, sink = mux(first).starts[0]
        assert first.in_flight == 1
        sink.put_nowait(admitted(PROMPT))
        sink.put_nowait(delta(100))
        sink.put_nowait(delta(101))
        # From the GenerateMany call's reader, a task of another request's context.
        contextvars.Context().run(sink.put_nowait, broken())

        (cont,), sink2 = await started(other)
        assert mux(other).request_ids == ["the-http-request"]  # its logs, its trace
        assert list(cont.token_ids.ids) == [*PROMPT, 100, 101]
        assert cont.num_resumed_output_tokens == 2  # output, not prompt
        assert cont.params.max_tokens == 5 and cont.params.min_tokens == 3
        assert cont.params.seed == 7 and not cont.params.HasField("prompt_logprobs")
        assert (first.in_flight, other.in_flight, first.up) == (0, 1, False)
        sink2.put_nowait(admitted([*PROMPT, 100, 101]))  # not passed on
        sink2.put_nowait(delta(102))
        # The control plane counts the resumed output as output, the prompt as prompt.
        usage = pb.Usage(prompt_tokens=3, completion_tokens=4, cached_prompt_tokens=3)
        sink2.put_nowait(delta(103, finish=pb.FINISH_REASON_LENGTH, usage=usage))
        sink2.put_nowait(None)

        states, total, prompts = await task
        assert states[0].text == "Hello world" and states[0].token_ids == [100, 101, 102, 103]
        assert states[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert (total.prompt_tokens, total.completion_tokens) == (3, 4)
        assert total.cached_prompt_tokens == 3
        assert prompts == [PROMPT]
        assert other.in_flight == 0

    run(go)


def test_a_call_with_no_output_yet_is_sent_again_as_it_was() -> None:
    async def go() -> None:
        router, planes = make_router()
        original = request(n=2)  # n > 1 is fine before any output
        task = await start(router, original)
        first, other = first_and_other(planes)
        _, sink = mux(first).starts[0]
        sink.put_nowait(admitted(PROMPT))
        sink.put_nowait(broken())
        (again,), sink2 = await started(other)
        assert again == original
        sink2.put_nowait(admitted(PROMPT))  # the client had it: not passed on twice
        resp = pb.GenerateResponse(usage=pb.Usage(prompt_tokens=3, completion_tokens=2))
        for i in range(2):
            resp.choices.add(index=i, token_ids=[104], text="!", finish_reason=1)
        sink2.put_nowait((0, resp))
        sink2.put_nowait(None)
        states, total, _ = await task
        assert [states[i].text for i in (0, 1)] == ["!", "!"]
        assert (total.prompt_tokens, total.completion_tokens) == (3, 2)

    run(go)


@pytest.mark.parametrize(
    ("params", "tokens", "why"),
    [
        ({"n": 2}, [100], "n > 1"),
        ({}, [100, 200], "inside a character"),  # the client has "Hel", not half of the next
    ],
)
def test_what_cannot_be_continued_exactly_fails_with_503(
    params: dict[str, Any], tokens: list[int], why: str
) -> None:
    async def go() -> None:
        router, planes = make_router()
        task = await start(router, request(**params))
        first, other = first_and_other(planes)
        _, sink = mux(first).starts[0]
        sink.put_nowait(admitted(PROMPT))
        for t in tokens:
            sink.put_nowait(delta(t))
        sink.put_nowait(broken())
        with pytest.raises(APIError) as e:
            await task
        assert e.value.status == 503 and why in e.value.message
        assert not mux(other).starts and other.in_flight == 0

    run(go)


def test_a_refusal_is_the_clients_but_unavailable_moves_on() -> None:
    async def go() -> None:
        router, planes = make_router()
        task = await start(router, request())
        first, other = first_and_other(planes)
        mux(first).starts[0][1].put_nowait((0, from_code("INVALID_ARGUMENT", "bad prompt")))
        with pytest.raises(APIError) as e:
            await task
        assert e.value.status == 400 and not mux(other).starts and first.up

        task = await start(router, request())
        (first,) = [p for p in planes if p.in_flight]
        (other,) = [p for p in planes if p is not first]
        n = len(mux(other).starts)
        mux(first).starts[-1][1].put_nowait((0, from_code("UNAVAILABLE", "shutting down")))
        _, sink = await started(other, n + 1)
        assert not first.up
        sink.put_nowait(admitted(PROMPT))
        sink.put_nowait(delta(104, finish=1, usage=pb.Usage(prompt_tokens=3, completion_tokens=1)))
        sink.put_nowait(None)
        assert (await task)[0][0].text == "!"

    run(go)


def test_a_refusal_says_which_of_the_calls_it_is() -> None:
    """(So that a completions batch's 400 names the prompt: prompt.2.)"""

    async def go() -> None:
        router, (only,) = make_router(n=1)
        task = asyncio.create_task(collect_calls(router, [request()] * 3, 60))
        _, sink = await started(only)
        sink.put_nowait((2, from_code("INVALID_ARGUMENT", "prompt: token id 9 is out of ...")))
        with pytest.raises(APIError) as e:
            await task
        assert e.value.status == 400 and e.value.call_index == 2

    run(go)


def test_with_one_control_plane_a_broken_call_fails_at_once() -> None:
    async def go() -> None:
        router, (only,) = make_router(n=1)
        task = await start(router, request())
        _, sink = mux(only).starts[0]
        sink.put_nowait(admitted(PROMPT))
        sink.put_nowait(delta(100))
        sink.put_nowait(broken())
        with pytest.raises(Broken):
            await asyncio.wait_for(task, 0.5)
        assert only.in_flight == 0

    run(go)


def test_a_call_waits_for_a_plane_to_come_up_then_gives_up() -> None:
    async def go() -> None:
        router, planes = make_router(retry_timeout=0.3)
        task = await start(router, request())
        first, other = first_and_other(planes)
        other.up = False
        _, sink = mux(first).starts[0]
        sink.put_nowait(admitted(PROMPT))
        sink.put_nowait(delta(100))
        sink.put_nowait(broken())
        await asyncio.sleep(0.1)
        assert not mux(other).starts  # it waits
        other.up = True
        (cont,), _ = await started(other)
        assert list(cont.token_ids.ids) == [*PROMPT, 100]
        router.cancel([next(iter(router._sessions))])  # the client went away
        task.cancel()
        assert other.in_flight == 0

        other.up = False
        loop = asyncio.get_running_loop()
        task = await start(router, request())
        (plane,) = [p for p in planes if p.in_flight]
        plane.up = True
        mux(plane).starts[-1][1].put_nowait(broken())
        begun = loop.time()
        with pytest.raises(Broken):  # the error the call failed with
            await task
        assert 0.25 < loop.time() - begun < 1.0

    run(go)


def test_the_router_places_calls_by_prefix_and_spreads_load() -> None:
    async def go() -> None:
        router, planes = make_router(n=2)
        preamble = "A long shared system prompt. " * 12
        for i in range(6):
            call = pb.GenerateRequest(text=preamble + str(i))
            await start(router, call)
        assert sorted(p.in_flight for p in planes) == [0, 6]  # one prefix, one plane
        for i in range(40):
            await start(router, pb.GenerateRequest(text=f"prompt {i}"))
        counts = sorted(p.in_flight for p in planes)
        assert counts[0] >= 10  # different prompts spread over both

    run(go)
