"""The control planes behind the gateway: each with its own gRPC channel, GenerateMany
call (gateway.multiplex) and count of calls in flight; which of them are up; and which
one a call goes to (gateway.placement).

The set comes from `--control` (hetero_common.discovery). Host names are resolved again every
`control_resolve_interval` seconds: a new address joins at once, one that is gone gets
no new calls and is closed once its calls have ended.

A plane is up until a call on it breaks, it refuses one as unavailable, or a probe finds
it not serving (its gRPC health: NOT_SERVING without a compute plane or while draining,
or no answer). A plane that is down gets no new calls while another is up, and is
probed every PROBE_INTERVAL seconds until it serves again; every plane is probed every
`control_resolve_interval` seconds. Going down is a WARNING once a plane has served,
an INFO line while it is still starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import metrics, placement
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.multiplex import Multiplexer
from hetero_common import discovery
from hetero_common.metrics import forget_series
from hetero_common.tls import ClientTLS
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PROBE_INTERVAL = 1.0  # seconds between probes of a plane that is down


def unavailable(message: str = "no control plane is available") -> APIError:
    return APIError(503, message, type="service_unavailable")


class ControlPlane:
    """One control plane: its channel (opened on first use), its GenerateMany call, its load."""

    def __init__(self, address: str, host: str, tls: ClientTLS) -> None:
        self.address = address  # as dialed: IP:PORT, or [IPv6]:PORT
        self.host = host  # the name it came from: TLS verifies the server by it
        self._tls = tls
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.ControlPlaneStub | None = None
        self.health: health_pb2_grpc.HealthStub | None = None
        self.mux = Multiplexer(self.open)
        self.in_flight = 0
        self.up = True  # until shown otherwise
        # Shown ready once (health SERVING, or ModelInfo with a compute plane attached):
        # until then "down" is a plane still starting (the planes start in any order, a
        # compute plane loads), logged at INFO; after, it is a WARNING.
        self.served = False
        metrics.control_in_flight.labels(control=address).set(0)

    def open(self) -> pb_grpc.ControlPlaneStub:
        if self.stub is None:
            # One GenerateMany message holds a step's output for every request, and the
            # admission of many long prompts at once: past gRPC's 4 MB default it would
            # end the call, and every request on it.
            options: list[tuple[str, object]] = [("grpc.max_receive_message_length", -1)]
            if self._tls.enabled and not discovery.is_ip(self.host):
                options.append(("grpc.ssl_target_name_override", self.host))
            self.channel = self._tls.aio_channel(self.address, options)
            self.stub = pb_grpc.ControlPlaneStub(self.channel)
            self.health = health_pb2_grpc.HealthStub(self.channel)
        return self.stub

    def add_in_flight(self, delta: int) -> None:
        self.in_flight += delta
        metrics.control_in_flight.labels(control=self.address).set(self.in_flight)

    def set_up(self, up: bool, why: str = "") -> None:
        if up != self.up:
            if up:
                log.info("control plane %s is up", self.address)
            elif self.served:
                log.warning("control plane %s is down: %s", self.address, why)
            else:
                log.info("control plane %s is not serving yet: %s", self.address, why)
        self.up = up
        self.served = self.served or up

    async def probe(self, timeout: float) -> None:
        """Up when its gRPC health is SERVING: a compute plane attached, not draining."""
        self.open()
        assert self.health is not None  # opened with the channel
        try:
            resp = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self.set_up(False, e.code().name)
            return
        serving = resp.status == health_pb2.HealthCheckResponse.SERVING
        self.set_up(serving, "not serving (no compute plane attached, or draining)")

    async def info(self, timeout: float) -> pb.ModelInfoResponse:
        """ModelInfo (a plane that does not answer, or has no compute plane, is down)."""
        try:
            info = await self.open().ModelInfo(pb.ModelInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self.set_up(False, e.code().name)
            raise
        if not info.compute_attached:
            self.set_up(False, "no compute plane attached, or draining")
        else:
            self.served = True
        return info

    async def close(self) -> None:
        # (first: the address may come back as a new plane while this one closes)
        forget_series([metrics.control_in_flight, metrics.routed], "control", self.address)
        await self.mux.close()
        if self.channel is not None:
            await self.channel.close()


class ControlPlanes:
    """Every control plane of `--control`, kept up to date while the gateway runs."""

    def __init__(self, config: GatewayConfig) -> None:
        self.spec = config.control
        self.tls = config.control_tls
        self.resolve_interval = config.control_resolve_interval
        self.planes: dict[str, ControlPlane] = {}  # by address, in `--control` order
        self.leaving: list[ControlPlane] = []  # gone from DNS, finishing their calls
        self.ring = placement.HashRing(())
        found = discovery.static_addresses(self.spec)
        self.dynamic = found is None  # host names: resolved now and again
        if found is not None:
            self._update(found)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Resolve the host names once, then keep watching (a task until `close`)."""
        if self.dynamic and not self.planes:
            await self.refresh()
        self.ensure_running()

    def ensure_running(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="control")

    async def refresh(self) -> None:
        found = await discovery.resolve(self.spec)
        if found is None or (not found and self.planes):
            return  # a lookup failure, or every name gone at once: keep what is known
        self._update(found)

    def _update(self, found: dict[str, str]) -> None:
        gone = [a for a in self.planes if a not in found]
        new = [a for a in found if a not in self.planes]
        if not gone and not new:
            return
        for address in gone:
            self.leaving.append(self.planes.pop(address))
        for address in new:
            back = [p for p in self.leaving if p.address == address]  # left, and is back
            self.leaving = [p for p in self.leaving if p.address != address]
            self.planes[address] = (
                back[0] if back else ControlPlane(address, found[address], self.tls)
            )
        self.ring = placement.HashRing(self.planes)
        log.info(
            "control planes: %s (joined: %s; leaving: %s)",
            ", ".join(self.planes) or "none",
            ", ".join(new) or "none",
            ", ".join(gone) or "none",
        )

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        next_all = loop.time() + self.resolve_interval
        while True:
            await asyncio.sleep(PROBE_INTERVAL)
            every = loop.time() >= next_all
            if every:
                next_all = loop.time() + self.resolve_interval
            try:
                await self.tick(every)
            except Exception:
                log.exception("watching the control planes")

    async def tick(self, every: bool) -> None:
        """One round of watching: with `every`, resolve the names again and probe every
        plane, else only those that are down; close the planes that left and are idle."""
        if every and self.dynamic:
            await self.refresh()
        probe = [p for p in self.planes.values() if every or not p.up]
        await asyncio.gather(*(p.probe(PROBE_INTERVAL) for p in probe))
        for plane in [p for p in self.leaving if p.in_flight <= 0]:
            self.leaving.remove(plane)
            await plane.close()

    def pick(
        self, key: str, exclude: set[str] | frozenset[str] = frozenset(), only_up: bool = False
    ) -> tuple[ControlPlane, str] | None:
        """The plane for a call with this routing key, and why (placement.choose)."""
        planes = self.planes
        order = (a for a in self.ring.walk(key) if a not in exclude)
        up = {a: p.up for a, p in planes.items()}
        load = {a: p.in_flight for a, p in planes.items()}
        chosen = placement.choose(order, up, load, only_up)
        if chosen is None:
            return None
        return planes[chosen[0]], chosen[1]

    def stub(self) -> pb_grpc.ControlPlaneStub:
        """A stub of the least loaded plane that is up (Tokenize, Detokenize)."""
        planes = [p for p in self.planes.values() if p.up] or list(self.planes.values())
        if not planes:
            raise unavailable()
        return min(planes, key=lambda p: p.in_flight).open()

    async def info(self, timeout: float) -> pb.ModelInfoResponse:
        """ModelInfo of a plane with a compute plane attached, else of one that answers.

        Every plane is asked (its answer marks it up or down); the first attached one's
        answer returns at once, so one unreachable plane does not slow a readiness probe.
        """
        self.ensure_running()
        if self.dynamic and not self.planes:
            await self.refresh()
        if not self.planes:
            raise unavailable()
        asks = [asyncio.ensure_future(p.info(timeout)) for p in self.planes.values()]
        for ask in asks:  # those still running when this returns finish on their own
            ask.add_done_callback(_retrieved)
        answered: list[pb.ModelInfoResponse] = []
        reason = "no answer"
        for next_answer in asyncio.as_completed(asks):
            try:
                info = await next_answer
            except grpc.aio.AioRpcError as e:
                reason = e.code().name
                continue
            if info.compute_attached:
                return info
            answered.append(info)
        if answered:
            return answered[0]
        raise unavailable(f"control plane unavailable: {reason}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for plane in [*self.planes.values(), *self.leaving]:
            await plane.close()


def _retrieved(task: asyncio.Future[pb.ModelInfoResponse]) -> None:
    """Mark a finished ask's error as seen (the plane is marked down already)."""
    if not task.cancelled():
        task.exception()
