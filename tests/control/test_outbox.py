"""A GenerateMany call's outbox: what a client reads, in the documented order, is what
the steps produced, in order, however the writer's takes fall between the steps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.scheduler import AdmissionError
from control_plane.server import CallOutbox, ControlServicer, _ManyCall
from hetero_common.packed import packed_responses
from hetero_proto import control_pb2 as pb
from tests.grpc_context import Aborted, Context

# A step: for each request that produced something, True for a packed delta and False
# for a full response (an admission, a finish, a delta with logprobs or a stop string).
steps_strategy = st.lists(
    st.tuples(
        st.dictionaries(st.sampled_from("abcd"), st.booleans(), max_size=4),
        st.booleans(),  # the writer takes the outbox after this step
    ),
    max_size=12,
)


def _servicer(prompt_ids: Any = None) -> ControlServicer:
    """A ControlServicer over no engine, whose prompts are tokenised by `prompt_ids`."""
    engine = SimpleNamespace(tokenizer=None, scheduler=None, check_accepting=lambda: None)
    servicer = ControlServicer(engine, "m")  # type: ignore[arg-type]
    if prompt_ids is not None:
        servicer._prompt_ids = prompt_ids  # type: ignore[method-assign]
    return servicer


def _refuse(request: pb.GenerateRequest, add_special_tokens: bool) -> list[int]:
    raise AdmissionError(f"{request.request_id} refused")


def _read(message: pb.GenerateManyResponse) -> list[tuple[str, str]]:
    """(request id, text) in the order control.proto says to read a message."""
    out = [(r.request_id, r.choices[0].text) for r in message.responses]
    return out + [(r.request_id, r.choices[0].text) for r in packed_responses(message.packed)]


def _run(steps: list[tuple[dict[str, bool], bool]]) -> tuple[dict[str, list[str]], int]:
    """Feed the steps to an outbox; what each request read, and the messages written."""

    async def go() -> tuple[dict[str, list[str]], int]:
        box = CallOutbox()
        read: dict[str, list[str]] = {}
        written = 0
        for n, (produced, take) in enumerate(steps):
            for rid, plain in produced.items():
                text = f"{rid}{n}"
                if plain:
                    box.delta(rid, [n], text)
                else:
                    resp = box.add(rid)
                    resp.choices.add(text=text, token_ids=[n])
                    box.sent(rid, last=False)
            if take or n == len(steps) - 1:
                if box.empty:
                    continue
                messages, _ = await box.take()
                for m in messages:
                    written += 1
                    for rid, text in _read(
                        pb.GenerateManyResponse.FromString(m.SerializeToString())
                    ):
                        read.setdefault(rid, []).append(text)
        return read, written

    return asyncio.run(go())


@settings(max_examples=200, deadline=None)
@given(steps_strategy)
def test_every_request_reads_its_messages_in_step_order(steps) -> None:  # type: ignore[no-untyped-def]
    read, _ = _run(steps)
    expected: dict[str, list[str]] = {}
    for n, (produced, _take) in enumerate(steps):
        for rid in produced:
            expected.setdefault(rid, []).append(f"{rid}{n}")
    assert read == expected


def test_a_full_response_after_a_packed_delta_of_its_request_starts_a_new_message() -> None:
    # Two steps gathered before the writer wakes: step 0 packs a delta of "a", step 1
    # finishes "a" with a full response. Read as one message, the finish would come first.
    read, written = _run([({"a": True, "b": False}, False), ({"a": False, "b": True}, True)])
    assert read == {"a": ["a0", "a1"], "b": ["b0", "b1"]}
    assert written == 2
    # Without the conflict, two steps share one message.
    read, written = _run([({"a": False}, False), ({"a": True, "b": True}, True)])
    assert read == {"a": ["a0", "a1"], "b": ["b1"]}
    assert written == 1


def test_packed_deltas_stand_for_their_responses() -> None:
    packed = pb.PackedDeltas(
        request_ids=["x", "y", "x"],
        texts=["A", "", "BC"],
        num_tokens=[1, 0, 2],
        token_ids=[7, 8, 9],
    )
    got = list(packed_responses(packed))
    assert [(r.request_id, r.choices[0].text, list(r.choices[0].token_ids)) for r in got] == [
        ("x", "A", [7]),
        ("y", "", []),
        ("x", "BC", [8, 9]),
    ]
    assert all(r.choices[0].stop_token_id == -1 and not r.choices[0].finish_reason for r in got)
    packed.token_ids.append(10)
    with pytest.raises(ValueError, match="adding up to 3, for 4 token_ids"):
        next(packed_responses(packed))
    del packed.token_ids[-1]
    packed.texts.append("D")
    with pytest.raises(ValueError, match="3 request_ids, 4 texts"):
        next(packed_responses(packed))  # before the first entry is yielded


def test_errors_and_ends_go_with_the_message_they_belong_to() -> None:
    async def go() -> None:
        box = CallOutbox()
        box.delta("a", [1], "x")
        box.fail("b", ValueError("boom"))
        resp = box.add("c")
        resp.choices.add(text="y")
        box.sent("c", last=True)
        box.add("a").choices.add(text="z")  # after its packed delta: a new message
        box.sent("a", last=True)
        messages, ended = await box.take()
        assert ended == [("b", None), ("c", None), ("a", None)]
        assert [_read(m) for m in messages] == [[("c", "y"), ("a", "x")], [("a", "z")]]
        assert [(e.request_id, e.code) for e in messages[0].errors] == [("b", "INTERNAL")]
        assert not messages[1].errors
        assert box.empty
        box.wake()  # woken with nothing to send: no message
        assert await box.take() == ([], [])

    asyncio.run(go())


def test_a_request_that_took_a_cancelled_ones_id_stays_tracked() -> None:
    """GenerateMany: request x is cancelled while its last message waits in the outbox, and
    a new x starts. When that message goes out, the new x is still the call's (so a later
    cancel, or the call's end, still aborts it); its own end then lets it go."""

    async def go() -> None:
        call = _ManyCall(SimpleNamespace(engine=None))  # type: ignore[arg-type]
        box = call.outbox
        old, new = object(), object()  # (the two requests' streams)
        box.add("x").choices.add(text="end")
        box.sent("x", last=True, owner=old)
        call.running["x"] = new  # cancel x, start x again, before the write
        _, ended = await box.take()
        call.forget(ended)
        assert call.running == {"x": new}
        box.fail("x", ValueError("gone"), owner=new)
        _, ended = await box.take()
        call.forget(ended)
        assert call.running == {}

    asyncio.run(go())


def test_a_refusal_after_the_client_stopped_sending_is_still_written() -> None:
    """GenerateMany: the client sent its last start and half-closed, and that request is
    refused while the call's writer is still sending an earlier message. The call ends
    only after the refusal is written, not with it left in the outbox."""

    async def go() -> None:
        release = threading.Event()

        def prompt_ids(request: pb.GenerateRequest) -> list[int]:
            if request.request_id == "late":
                release.wait(10)
            raise AdmissionError(f"{request.request_id} refused")

        servicer = _servicer(prompt_ids)

        async def starts() -> AsyncIterator[pb.GenerateManyRequest]:
            for rid in ("early", "late"):
                yield pb.GenerateManyRequest(start=pb.GenerateRequest(request_id=rid))

        call = servicer.GenerateMany(starts(), None)  # type: ignore[arg-type]
        first = await anext(call)  # the writer now waits at this message's yield
        release.set()
        await asyncio.sleep(0.2)  # "late" is refused meanwhile
        rest = [m async for m in call]
        written = [e.request_id for m in [first, *rest] for e in m.errors]
        assert written == ["early", "late"]

    asyncio.run(go())


def test_a_message_without_an_action_is_an_error_not_ignored() -> None:
    """GenerateMany: a message that sets neither start nor cancel (sent by mistake, or an
    action this server does not know) gets an INVALID_ARGUMENT error with no request id,
    and the call goes on with the next message's request."""

    async def go() -> None:
        servicer = _servicer(_refuse)

        async def messages() -> AsyncIterator[pb.GenerateManyRequest]:
            yield pb.GenerateManyRequest()
            yield pb.GenerateManyRequest(accept_packed=True)
            yield pb.GenerateManyRequest(start=pb.GenerateRequest(request_id="next"))

        call = servicer.GenerateMany(messages(), None)  # type: ignore[arg-type]
        errors = [e for m in [m async for m in call] for e in m.errors]
        assert [(e.request_id, e.code) for e in errors] == [
            ("", "INVALID_ARGUMENT"),
            ("", "INVALID_ARGUMENT"),
            ("next", "INVALID_ARGUMENT"),
        ]
        assert "start or cancel" in errors[0].message
        assert errors[2].message == "next refused"

    asyncio.run(go())


def test_a_stopping_server_ends_a_call_paused_at_its_write() -> None:
    """end_calls (the server stops, drained) while a GenerateMany call is paused at a
    message's yield, as it is while grpc writes that message: the call ends with
    UNAVAILABLE 'the control plane stopped' when it resumes. end_calls cancelled the
    handler's task, and a cancel landing in grpc's write left the call to the server's
    1 s stop grace ('Cancelling all calls'; a flaky end-to-end failure in CI)."""

    async def go() -> None:
        servicer = _servicer(_refuse)
        never = asyncio.Event()

        async def messages() -> AsyncIterator[pb.GenerateManyRequest]:
            yield pb.GenerateManyRequest(start=pb.GenerateRequest(request_id="a"))
            await never.wait()  # the call stays open, as a gateway's

        context = Context()
        call = servicer.GenerateMany(messages(), context)  # type: ignore[arg-type]
        first = await anext(call)  # paused at this message's yield
        assert [e.request_id for e in first.errors] == ["a"]
        servicer.end_calls()
        with pytest.raises(Aborted):
            await asyncio.wait_for(anext(call), 5)
        assert context.status == (grpc.StatusCode.UNAVAILABLE, "the control plane stopped")
        assert not servicer._calls

        # A call opened after the stop began ends at once.
        context = Context()
        with pytest.raises(Aborted):
            await asyncio.wait_for(anext(servicer.GenerateMany(messages(), context)), 5)  # type: ignore[arg-type]
        assert context.status == (grpc.StatusCode.UNAVAILABLE, "the control plane stopped")

    asyncio.run(go())


def test_a_stopping_server_ends_an_idle_call() -> None:
    """end_calls while a GenerateMany call waits for its next message (a gateway's call
    between requests): it ends with UNAVAILABLE 'the control plane stopped'."""

    async def go() -> None:
        servicer = _servicer()
        never = asyncio.Event()

        async def messages() -> AsyncIterator[pb.GenerateManyRequest]:
            await never.wait()
            yield pb.GenerateManyRequest()

        context = Context()
        call = servicer.GenerateMany(messages(), context)  # type: ignore[arg-type]
        waiting = asyncio.ensure_future(anext(call))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        servicer.end_calls()
        with pytest.raises(Aborted):
            await asyncio.wait_for(waiting, 5)
        assert context.status == (grpc.StatusCode.UNAVAILABLE, "the control plane stopped")

    asyncio.run(go())
