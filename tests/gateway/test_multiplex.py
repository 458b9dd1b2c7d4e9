"""The gateway's GenerateMany multiplexer (gateway.multiplex) when clients reuse their
X-Request-Id: a call is named after its HTTP request unless a start not yet cancelled,
or a call cancelled while it ran, holds that name; a start's cancel and deadline act on
its own calls only. A scripted GenerateMany call stands for the control plane; the unit
under test is the multiplexer's bookkeeping."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest

from gateway import multiplex
from gateway.errors import APIError
from gateway.multiplex import Multiplexer
from hetero_common.logs import REQUEST_ID
from hetero_proto import control_pb2 as pb

CALL = pb.GenerateRequest(text="hi")


class ScriptedCall:
    """A GenerateMany call whose responses the test sends (`answer`); it keeps what the
    gateway writes."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[pb.GenerateManyResponse | Exception | None] = asyncio.Queue()
        self.written: list[pb.GenerateManyRequest] = []

    async def write(self, message: pb.GenerateManyRequest) -> None:
        self.written.append(message)

    async def read(self) -> Any:
        message = await self.inbox.get()
        if isinstance(message, Exception):  # the call ends with this error
            raise message
        return grpc.aio.EOF if message is None else message

    def cancel(self) -> None:
        self.inbox.put_nowait(None)

    def answer(self, rid: str, text: str = "", last: bool = False) -> None:
        message = pb.GenerateManyResponse()
        resp = message.responses.add(request_id=rid)
        resp.choices.add(index=0, text=text)
        if last:
            resp.usage.prompt_tokens = 1
        self.inbox.put_nowait(message)

    @property
    def cancels(self) -> list[str]:
        return [m.cancel for m in self.written if m.WhichOneof("action") == "cancel"]


def run(body: Callable[[Multiplexer, ScriptedCall], Coroutine[Any, Any, None]]) -> None:
    async def go() -> None:
        call = ScriptedCall()
        stub = type("Stub", (), {"GenerateMany": lambda self: call})()
        mux = Multiplexer(lambda: stub)  # type: ignore[arg-type,return-value]
        token = REQUEST_ID.set("client-id")  # the HTTP request's id (X-Request-Id)
        try:
            await body(mux, call)
        finally:
            REQUEST_ID.reset(token)
            await mux.close()

    asyncio.run(go())


async def settle() -> None:
    for _ in range(5):  # (the reader and writer tasks take their turns)
        await asyncio.sleep(0)


def drain(queue: asyncio.Queue[Any]) -> list[Any]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def served(
    mux: Multiplexer, call: ScriptedCall, q: asyncio.Queue[Any], text: str = ""
) -> list[str]:
    """One call started, answered to its end (`text`) and its start cancelled, as its HTTP
    request ends: the GenerateMany call is idle again. Returns the start's ids."""
    ids = mux.start([CALL], q, 600)
    await settle()
    call.answer(ids[0], text, last=True)
    await settle()
    mux.cancel(ids)
    return ids


class Unavailable(grpc.aio.AioRpcError):
    """The status a control plane that stops ends its open GenerateMany calls with."""

    def __init__(self) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            "the control plane stopped",
        )


def test_a_reused_id_while_another_prompt_of_its_start_runs_keeps_both_apart() -> None:
    """A: two prompts; its first ends, its second runs. B, with A's X-Request-Id, starts
    then. A's end (its HTTP request's cancel) leaves B alone, and B's deadline holds."""

    async def body(mux: Multiplexer, call: ScriptedCall) -> None:
        qa: asyncio.Queue[Any] = asyncio.Queue()
        qb: asyncio.Queue[Any] = asyncio.Queue()
        a = mux.start([CALL, CALL], qa, 600)
        assert a == ["client-id-p0", "client-id-p1"]
        await settle()
        call.answer(a[0], "x", last=True)
        await settle()
        b = mux.start([CALL, CALL], qb, 0.2)
        assert not set(a) & set(b) and all(r.startswith("client-id-p") for r in b)
        mux.cancel(a)
        await settle()
        assert call.cancels == [a[1]]  # A's running prompt, none of B's
        call.answer(b[0], "y")
        await asyncio.sleep(0.4)  # past B's deadline
        items = drain(qb)
        assert items[0][0] == 0 and items[0][1].choices[0].text == "y"
        assert isinstance(items[-1], APIError) and items[-1].status == 504
        assert sorted(call.cancels) == sorted([a[1], *b])

    run(body)


def test_a_start_past_its_deadline_frees_its_names_once() -> None:
    """A passes its deadline (504, its call cancelled). B reuses the id: it gets a new name,
    since A's messages may still be on their way; one that comes does not reach B. A's
    HTTP request then cancels A: B is untouched."""

    async def body(mux: Multiplexer, call: ScriptedCall) -> None:
        qa: asyncio.Queue[Any] = asyncio.Queue()
        qb: asyncio.Queue[Any] = asyncio.Queue()
        a = mux.start([CALL], qa, 0.05)
        await asyncio.sleep(0.15)
        assert [type(i) for i in drain(qa)] == [APIError] and call.cancels == a
        b = mux.start([CALL], qb, 600)
        assert b != a and b[0].startswith("client-id~")
        call.answer(a[0], "stale")  # sent before the control plane read A's cancel
        call.answer(b[0], "fresh")
        await settle()
        assert [i[1].choices[0].text for i in drain(qb)] == ["fresh"]
        mux.cancel(a)  # (the HTTP request's own cancel, after the deadline's)
        await settle()
        assert call.cancels == a
        call.answer(b[0], "", last=True)
        await settle()
        assert drain(qb)[-1] is None  # B ended normally
        mux.cancel(b)
        assert call.cancels == a  # (it had ended: nothing to cancel)

    run(body)


def test_an_id_is_the_clients_again_once_nothing_can_come_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call that ended names nothing: its id is free at once. One cancelled while it
    ran is free after CANCELLED_KEEP, and the record of it goes."""

    async def body(mux: Multiplexer, call: ScriptedCall) -> None:
        q: asyncio.Queue[Any] = asyncio.Queue()
        a = await served(mux, call, q)
        b = mux.start([CALL], q, 600)
        assert a == b == ["client-id"]
        mux.cancel(["client-id"])  # not the list `start` returned: not b's start's cancel
        await settle()
        assert not call.cancels
        mux.cancel(b)  # while it runs
        await settle()
        assert call.cancels == b
        monkeypatch.setattr(multiplex, "CANCELLED_KEEP", 0.05)
        c = mux.start([CALL], q, 600)
        assert c[0].startswith("client-id~")  # b's messages may still come
        mux.cancel(c)
        await asyncio.sleep(0.1)
        assert mux.start([CALL], q, 600) == ["client-id"]
        assert not mux._cancelled  # (both records went)

    run(body)


def test_the_calls_own_log_lines_carry_no_requests_id() -> None:
    """The GenerateMany call outlives the HTTP request that opened it: its end (a control
    plane stopped long after that request finished) was logged under that request's id,
    as the reader and writer tasks inherited its context ('GenerateMany call to the
    control plane ended: UNAVAILABLE [<an id whose request had succeeded>]')."""
    seen: list[tuple[str, str | None]] = []

    class Ids(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.getMessage(), REQUEST_ID.get()))

    async def body(mux: Multiplexer, call: ScriptedCall) -> None:
        await served(mux, call, asyncio.Queue())
        call.inbox.put_nowait(Unavailable())  # the control plane stopped, long after
        await settle()

    handler = Ids()
    log = logging.getLogger("gateway")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # (an idle call's end is an INFO line)
    try:
        run(body)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    ended = [rid for message, rid in seen if "GenerateMany call" in message]
    assert ended == [None], seen


def test_an_idle_call_ended_by_the_control_plane_is_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`serve` stopped with Ctrl-C: the control plane ends the gateway's idle call before
    the gateway has stopped (two WARNINGs at every clean stop). With no request on the
    call nothing is lost: one INFO line, and the next request opens a new call."""

    async def body(mux: Multiplexer, call: ScriptedCall) -> None:
        q: asyncio.Queue[Any] = asyncio.Queue()
        await served(mux, call, q, "done")
        call.inbox.put_nowait(Unavailable())
        await settle()
        assert mux._call is None  # (the next start opens a new call)
        assert [i[1].choices[0].text for i in drain(q)[:-1]] == ["done"]

    with caplog.at_level(logging.INFO, logger="gateway"):
        run(body)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("gateway")]
    assert lines == [
        (
            "INFO",
            "GenerateMany call to the control plane ended: UNAVAILABLE: the control plane "
            "stopped (no request on it)",
        )
    ], lines


def test_a_call_ended_under_running_requests_breaks_them_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same end with two requests running on the call: each gets `Broken` (a 503 here;
    a Router moves them on to another control plane) and a WARNING counts them."""

    async def body(mux: Multiplexer, call: ScriptedCall) -> None:
        q: asyncio.Queue[Any] = asyncio.Queue()
        mux.start([CALL, CALL], q, 600)
        await settle()
        call.inbox.put_nowait(Unavailable())
        await settle()
        errors = [item[1] for item in drain(q)]
        assert [(type(e).__name__, e.status) for e in errors] == [("Broken", 503)] * 2

    with caplog.at_level(logging.INFO, logger="gateway"):
        run(body)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        "GenerateMany call to the control plane ended: UNAVAILABLE with 2 requests running on it"
        in (warnings)
    ), warnings
