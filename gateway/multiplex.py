"""One GenerateMany call to the control plane that carries every request of this gateway.

The control plane then sends one message per step for all of them, where a Generate
call per request would cost it a message per request per step. Each HTTP request
registers its generate calls here and reads their responses from its own queue.

    mux = Multiplexer(stub_factory)
    ids = mux.start(calls, queue, timeout)  # queue gets (call index, GenerateResponse),
                                            # (call index, APIError) when a call fails,
                                            # or None when a call has ended
    mux.cancel(ids)                 # the control plane aborts them and frees their blocks

Past `timeout` seconds the calls still running are cancelled on the control plane and
the queue gets a 504, whether or not anyone is reading it. A call that fails because the
GenerateMany call under it broke gets a `Broken` error: nothing was said about the call
itself, so it may go on on another control plane (gateway.router).

A call is named after its HTTP request (the client's X-Request-Id, `-p<i>` per prompt)
unless that name is taken: by a start not yet cancelled (a client may reuse its id while
the first request runs, or while another prompt of it does), or by a call cancelled
while it ran less than `CANCELLED_KEEP` seconds ago (its messages may still be on their
way, and must not reach the new call). Then it gets a suffix. `cancel` acts on its own
start's calls only: once a start is cancelled (or past its deadline), its names may name
newer starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from contextvars import Context
from dataclasses import dataclass
from typing import Protocol

import grpc

from gateway.errors import APIError, from_code, from_grpc
from hetero_common.limits import MAX_GRPC_MESSAGE_BYTES
from hetero_common.logs import REQUEST_ID
from hetero_common.packed import packed_responses
from hetero_common.tracing import current_traceparent
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Item = tuple[int, pb.GenerateResponse | BaseException] | BaseException | None

CANCELLED_KEEP = 60.0  # seconds a call cancelled while it ran keeps its name out of use


class Sink(Protocol):
    """Where a start's messages go: an asyncio.Queue, or a router's bookkeeping."""

    def put_nowait(self, item: Item, /) -> None: ...


class Calls(Protocol):
    """What runs generate calls: a Multiplexer (one control plane), a Router (several)."""

    def start(self, calls: list[pb.GenerateRequest], queue: Sink, timeout: float) -> list[str]:
        """Start the calls; their messages go to `queue` as Item. Returns ids for `cancel`."""
        ...

    def cancel(self, ids: list[str]) -> None:
        """Abort the calls of a start that have not ended; they get no further message."""
        ...


class Broken(APIError):
    """The GenerateMany call under a request ended (the control plane died or restarted,
    the connection dropped): not an answer about the request, which may go on elsewhere."""

    @classmethod
    def of(cls, e: APIError) -> Broken:
        return cls(e.status, e.message, type=e.type, param=e.param, code=e.code)


@dataclass(slots=True)
class _Route:
    queue: Sink
    index: int  # the call's position in its start


class Multiplexer:
    """Routes the responses of one long-lived GenerateMany call to per-request queues.

    The call opens on first use and again after it breaks: a broken call (the control
    plane restarted, the connection dropped) ends every request on it with `Broken`
    (a 503), and the next request opens a new one.
    """

    def __init__(self, stub: Callable[[], pb_grpc.ControlPlaneStub]) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None
        self._outgoing: asyncio.Queue[pb.GenerateManyRequest] | None = None
        self._routes: dict[str, _Route] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # The calls of the starts not yet cancelled: id -> its start's ids (the list that
        # `start` returned, which `cancel` is given back)
        self._owned: dict[str, list[str]] = {}
        self._deadlines: dict[str, asyncio.TimerHandle] = {}  # first id of a start -> timer
        # Calls of the open GenerateMany call cancelled while they ran, oldest first: id ->
        # when (time.monotonic)
        self._cancelled: dict[str, float] = {}

    def start(self, calls: list[pb.GenerateRequest], queue: Sink, timeout: float) -> list[str]:
        """Send the calls; their responses go to `queue`. Returns their request ids."""
        starts = [pb.GenerateManyRequest(start=call, accept_packed=True) for call in calls]
        for s in starts:
            if s.ByteSize() > MAX_GRPC_MESSAGE_BYTES - 1024:  # room for the request id
                raise APIError(
                    413,
                    f"the request is too large for the control plane ({s.ByteSize()} bytes "
                    f"as a gRPC message; at most {MAX_GRPC_MESSAGE_BYTES})",
                )
        outgoing = self._open()
        ids: list[str] = []
        base = REQUEST_ID.get() or uuid.uuid4().hex  # the HTTP request's id, for the logs
        traceparent = current_traceparent()  # the HTTP request's span, when tracing
        cancelled, now = self._cancelled, time.monotonic()
        while cancelled and now - next(iter(cancelled.values())) >= CANCELLED_KEEP:
            del cancelled[next(iter(cancelled))]
        for i, start in enumerate(starts):
            rid = base if len(starts) == 1 else f"{base}-p{i}"
            if rid in self._owned or rid in cancelled:  # a client reused its X-Request-Id
                rid = f"{rid}~{uuid.uuid4().hex[:8]}"
            start.start.request_id = rid
            start.start.traceparent = traceparent
            self._routes[rid] = _Route(queue, i)
            self._owned[rid] = ids
            outgoing.put_nowait(start)
            ids.append(rid)
        loop = asyncio.get_running_loop()
        self._deadlines[ids[0]] = loop.call_later(timeout, self._expire, ids, queue)
        return ids

    def cancel(self, ids: list[str]) -> None:
        """Abort those of `ids` (a start's, as `start` returned them) that have not ended;
        they get no further message. Once more: nothing (the ids may name newer calls)."""
        if not ids or self._owned.get(ids[0]) is not ids:
            return
        if (timer := self._deadlines.pop(ids[0], None)) is not None:
            timer.cancel()
        for rid in ids:
            del self._owned[rid]
            if self._routes.pop(rid, None) is not None and self._outgoing is not None:
                self._outgoing.put_nowait(pb.GenerateManyRequest(cancel=rid))
                self._cancelled[rid] = time.monotonic()

    def _expire(self, ids: list[str], queue: Sink) -> None:
        """The deadline passed: free the control plane's work now, tell the reader 504."""
        running = [rid for rid in ids if rid in self._routes]
        self.cancel(ids)
        if running:
            queue.put_nowait(
                APIError(504, "Deadline Exceeded", type="timeout", code="deadline_exceeded")
            )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._call is not None:
            self._call.cancel()
        self._call = self._outgoing = None

    # ------------------------------------------------------------------ the call
    def _open(self) -> asyncio.Queue[pb.GenerateManyRequest]:
        if self._outgoing is not None:
            return self._outgoing
        call = self._stub().GenerateMany()
        outgoing: asyncio.Queue[pb.GenerateManyRequest] = asyncio.Queue()
        self._call, self._outgoing, self._routes = call, outgoing, {}
        self._cancelled = {}  # (the last call's messages do not come on this one)
        # The call outlives the request that opened it: its tasks run in a context of
        # their own, or their log lines would carry that request's id (REQUEST_ID).
        self._tasks = [
            asyncio.create_task(
                self._write(call, outgoing), name="generate-many-write", context=Context()
            ),
            asyncio.create_task(
                self._read(call, self._routes), name="generate-many-read", context=Context()
            ),
        ]
        return outgoing

    async def _write(
        self, call: grpc.aio.StreamStreamCall, outgoing: asyncio.Queue[pb.GenerateManyRequest]
    ) -> None:
        try:
            while True:
                await call.write(await outgoing.get())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            call.cancel()  # the reader sees the call end and fails its requests

    async def _read(self, call: grpc.aio.StreamStreamCall, routes: dict[str, _Route]) -> None:
        error = APIError(503, "the control plane ended the stream", type="service_unavailable")
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                assert isinstance(message, pb.GenerateManyResponse)
                for resp in message.responses:
                    route = routes.get(resp.request_id)
                    if route is None:
                        continue  # cancelled here while the message was on its way
                    # A copy: a part of the step's message would keep all of it alive
                    # for as long as a slow client leaves this response in its queue.
                    own = pb.GenerateResponse()
                    own.CopyFrom(resp)
                    route.queue.put_nowait((route.index, own))
                    if resp.HasField("usage"):
                        del routes[resp.request_id]
                        route.queue.put_nowait(None)
                for resp in packed_responses(message.packed):  # read after `responses`
                    if (route := routes.get(resp.request_id)) is not None:
                        route.queue.put_nowait((route.index, resp))
                for e in message.errors:
                    if (route := routes.pop(e.request_id, None)) is not None:
                        route.queue.put_nowait((route.index, from_code(e.code, e.message)))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and not routes:
                # An idle call ended (a control plane that stops ends its calls, as when
                # a Ctrl-C of `serve` stops it beside this gateway; the connection
                # dropped): nothing lost, the next request opens a new call.
                log.info(
                    "GenerateMany call to the control plane ended: %s: %s (no request on it)",
                    e.code().name,
                    e.details(),
                )
            elif e.code() != grpc.StatusCode.CANCELLED:
                error = from_grpc(e)  # (logs the control plane's words as a WARNING)
                log.warning(
                    "GenerateMany call to the control plane ended: %s with %d requests running "
                    "on it",
                    e.code().name,
                    len(routes),
                )
        except Exception:
            # A message that cannot be read: end the call, so that the control plane
            # stops its requests, and fail them here (503); the next request opens a new one.
            log.exception("GenerateMany: a message from the control plane could not be read")
            call.cancel()
        finally:
            if self._call is call:
                self._call = self._outgoing = None
                for task in self._tasks:
                    if task is not asyncio.current_task():
                        task.cancel()
            broken = Broken.of(error)
            for route in routes.values():
                route.queue.put_nowait((route.index, broken))
            routes.clear()
