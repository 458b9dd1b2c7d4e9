"""The gateway's generate calls on its control planes: each placed by prefix affinity and
load (gateway.placement), and moved to another control plane when its own fails.

    start(calls) ──pick a plane per call──▶ plane.mux.start ──▶ _Sink ──▶ the HTTP request's queue
                                                ▲                 │ Broken, or refused UNAVAILABLE
                                                └──── _move ◀─────┘ (another plane, gateway.resubmit)

The router keeps, for each call, what the client has been sent (the prompt's token ids,
the output tokens and text), which is what a re-submission needs. A continuation's
admission is not passed on (the client had the prompt's); its usage is the original
call's (the control plane counts the resumed output as output), so the HTTP request
reads one stream. Where no other control
plane is up, a call waits up to `control_retry_timeout` seconds for one; with no other
control plane at all it fails at once (503), as a gateway with one control plane does.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from dataclasses import dataclass, field

import grpc

from gateway import metrics, resubmit
from gateway.control_planes import ControlPlane, ControlPlanes, unavailable
from gateway.errors import APIError
from gateway.multiplex import Broken, Item, Sink
from gateway.placement import routing_key
from hetero_proto import control_pb2 as pb

log = logging.getLogger(__name__)

RETRY_PAUSE = 0.25  # seconds between looks for a control plane to move a call to
DETOKENIZE_TIMEOUT = 5.0
FAILOVER = "failover"  # the routed metric's reason for a re-submission


class _NotContinued(Exception):
    pass


@dataclass(eq=False)
class _Call:
    request: pb.GenerateRequest
    key: str  # routing key
    prompt_ids: list[int] | None = None  # from its admission
    output_ids: list[int] = field(default_factory=list)  # choice 0's tokens sent on
    texts: list[str] = field(default_factory=list)  # choice 0's text sent on
    delivered: bool = False  # some output went to the client
    plane: ControlPlane | None = None  # where it runs now (counted in its in_flight)
    sink: _Sink | None = None  # the start it runs in
    failed: set[str] = field(default_factory=set)  # planes that failed under it
    error: APIError | None = None  # the last failure, for the client if it cannot move


@dataclass(eq=False)
class _Session:
    """One HTTP request's calls."""

    key: str
    queue: Sink
    calls: list[_Call]
    deadline: float  # loop time
    starts: list[tuple[ControlPlane, list[str]]] = field(default_factory=list)
    moving: set[int] = field(default_factory=set)  # calls waiting for a plane
    mover: asyncio.Task[None] | None = None
    cancelled: bool = False
    # The HTTP request's context (its request id, trace span): a re-submission is its.
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


class _Sink:
    """One start on one plane: its messages, by position in the start, to the session."""

    __slots__ = ("indices", "router", "session")

    def __init__(self, router: Router, session: _Session, indices: list[int]) -> None:
        self.router, self.session, self.indices = router, session, indices

    def put_nowait(self, item: Item, /) -> None:
        self.router._receive(self, item)


class Router:
    """Runs generate calls (the gateway.multiplex.Calls interface) on several control planes."""

    def __init__(self, planes: ControlPlanes, retry_timeout: float) -> None:
        self.planes = planes
        self.retry_timeout = retry_timeout
        self._sessions: dict[str, _Session] = {}

    def start(self, calls: list[pb.GenerateRequest], queue: Sink, timeout: float) -> list[str]:
        self.planes.ensure_running()
        loop = asyncio.get_running_loop()
        s = _Session(
            uuid.uuid4().hex,
            queue,
            [_Call(c, routing_key(c)) for c in calls],
            loop.time() + timeout,
        )
        groups: dict[ControlPlane, tuple[list[int], list[str]]] = {}
        for i, call in enumerate(s.calls):
            picked = self.planes.pick(call.key)
            if picked is None:
                s.moving.add(i)  # no control plane known now
                continue
            indices, reasons = groups.setdefault(picked[0], ([], []))
            indices.append(i)
            reasons.append(picked[1])
        self._sessions[s.key] = s
        try:
            for plane, (indices, reasons) in groups.items():
                self._submit(s, plane, indices, [calls[i] for i in indices], reasons)
        except BaseException:
            self.cancel([s.key])
            raise
        if s.moving:
            self._schedule_move(s)
        return [s.key]

    def cancel(self, ids: list[str]) -> None:
        for key in ids:
            s = self._sessions.pop(key, None)
            if s is None:
                continue
            s.cancelled = True
            if s.mover is not None:
                s.mover.cancel()
            for plane, rids in s.starts:
                plane.mux.cancel(rids)
            for call in s.calls:
                self._release(call)

    # ------------------------------------------------------------ bookkeeping
    def _submit(
        self,
        s: _Session,
        plane: ControlPlane,
        indices: list[int],
        requests: list[pb.GenerateRequest],
        reasons: list[str],
    ) -> None:
        sink = _Sink(self, s, indices)
        timeout = s.deadline - asyncio.get_running_loop().time()
        rids = plane.mux.start(requests, sink, max(timeout, 1e-3))
        s.starts.append((plane, rids))
        for i, reason in zip(indices, reasons, strict=True):
            call = s.calls[i]
            call.plane, call.sink = plane, sink
            plane.add_in_flight(1)
            metrics.routed.labels(control=plane.address, reason=reason).inc()

    @staticmethod
    def _release(call: _Call) -> None:
        if call.plane is not None:
            call.plane.add_in_flight(-1)
            call.plane = None

    def _receive(self, sink: _Sink, item: Item) -> None:
        """A message of a start: note what the client gets, pass it on (or move the call)."""
        s = sink.session
        if item is None:  # a call ended, after its usage
            s.queue.put_nowait(None)
            return
        if not isinstance(item, tuple):  # the start's deadline: all of it is cancelled
            for i in sink.indices:
                if s.calls[i].sink is sink:
                    self._release(s.calls[i])
            s.queue.put_nowait(item)
            return
        local, resp = item
        i = sink.indices[local]
        call = s.calls[i]
        if call.sink is not sink:
            return  # moved on (nothing comes from a start after its failure; a guard)
        if isinstance(resp, BaseException):
            plane = call.plane
            self._release(call)
            # A broken call said nothing about the request; UNAVAILABLE is the control
            # plane saying it cannot serve it now (shutting down, no compute plane).
            movable = isinstance(resp, Broken) or (
                isinstance(resp, APIError) and resp.code == "unavailable"
            )
            if not isinstance(resp, APIError) or not movable or plane is None or s.cancelled:
                s.queue.put_nowait((i, resp))  # (with its index: a batch names the prompt)
                return
            plane.set_up(False, resp.message)
            call.failed.add(plane.address)
            call.error = resp
            call.sink = None
            s.moving.add(i)
            self._schedule_move(s)
            return
        if resp.prompt_token_ids:  # an admission: the plane serves (its end is a WARNING)
            if call.plane is not None:
                call.plane.served = True
            if call.prompt_ids is not None:
                return  # a re-submission's admission: the client has had the prompt's
            call.prompt_ids = list(resp.prompt_token_ids)
        for c in resp.choices:
            call.delivered = True
            if c.index == 0:
                call.output_ids += c.token_ids
                if c.text:
                    call.texts.append(c.text)
        if resp.HasField("usage"):  # a resumed call's counts its resumed output as output
            self._release(call)
        s.queue.put_nowait((i, resp))

    # ------------------------------------------------------------ re-submission
    def _schedule_move(self, s: _Session) -> None:
        if s.mover is None or s.mover.done():
            s.mover = asyncio.get_running_loop().create_task(
                self._move(s), name="move-calls", context=s.context.copy()
            )

    async def _move(self, s: _Session) -> None:
        """Place the session's calls that have no plane: on another plane that is up,
        waiting up to the retry timeout for one."""
        give_up = asyncio.get_running_loop().time() + self.retry_timeout
        while s.moving and not s.cancelled:
            i = min(s.moving)
            try:
                if not await self._move_one(s, i, give_up):
                    await asyncio.sleep(RETRY_PAUSE)
            except APIError as e:
                self._fail(s, i, e)
            except Exception:
                log.exception("moving a call to another control plane")
                self._fail(s, i, APIError(500, "internal error", type="internal_error"))

    async def _move_one(self, s: _Session, i: int, give_up: float) -> bool:
        """Place call i (True), or find no plane for it now (False: look again soon).
        Raises the APIError the client gets when it cannot be placed."""
        call = s.calls[i]
        now = asyncio.get_running_loop().time()
        if now >= s.deadline:
            raise APIError(504, "Deadline Exceeded", type="timeout", code="deadline_exceeded")
        picked = self.planes.pick(call.key, call.failed, only_up=bool(call.failed))
        if picked is None:
            waiting = any(a not in call.failed for a in self.planes.planes)
            if waiting and now < give_up:
                return False
            raise call.error or unavailable()
        plane, reason = picked
        try:
            request = await self._resubmission(call, plane)
        except _NotContinued as e:
            log.warning("a call cannot be continued on another control plane: %s", e)
            raise unavailable(
                "the control plane serving this request failed, and the request cannot be "
                f"continued exactly on another one ({e}); retry it"
            ) from None
        except grpc.aio.AioRpcError as e:
            plane.set_up(False, e.code().name)
            return True  # pick again: this plane is down now
        if not s.cancelled:
            s.moving.discard(i)
            self._submit(s, plane, [i], [request], [FAILOVER if call.failed else reason])
        return True

    async def _resubmission(self, call: _Call, plane: ControlPlane) -> pb.GenerateRequest:
        """The call as sent again: the original before any output was delivered, else its
        continuation (gateway.resubmit)."""
        if not call.delivered or call.prompt_ids is None:
            return call.request
        why = resubmit.why_not_continued(call.request)
        if why is not None:
            raise _NotContinued(why)
        if call.output_ids:
            skip = call.request.params.skip_special_tokens
            req = pb.DetokenizeRequest(token_ids=call.output_ids, skip_special_tokens=skip)
            text = (await plane.open().Detokenize(req, timeout=DETOKENIZE_TIMEOUT)).text
            if text != "".join(call.texts):
                raise _NotContinued("the output so far ends inside a character or stop string")
        request = resubmit.continuation(call.request, call.prompt_ids, call.output_ids)
        if request is None:
            raise _NotContinued("no tokens left to generate")
        return request

    def _fail(self, s: _Session, i: int, error: APIError) -> None:
        s.moving.discard(i)
        s.queue.put_nowait((i, error))
