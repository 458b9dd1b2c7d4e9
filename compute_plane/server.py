"""gRPC server of the compute plane: ComputePlane service, grpc.health.v1 and reflection.

The server listens at once and reports NOT_SERVING on health until the model is
loaded and warmed up; RPCs before that get UNAVAILABLE. Steps run on one worker
thread, so the engine is never entered twice and the event loop stays free for
health checks while a forward runs.

SIGTERM drains: health turns NOT_SERVING, new streams and Describe get UNAVAILABLE,
the open step stream keeps running with `draining` set on every result (so the control
plane sends no new requests), and the process exits once it holds no request, or
after --drain-timeout.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import prometheus_client

from compute_plane import metrics
from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine, StepRejected
from hetero_common.grpc_health import HealthReporter
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputePlane"].full_name


class ComputeServicer(pb_grpc.ComputePlaneServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.draining = False
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def _engine(self, context: grpc.aio.ServicerContext) -> Engine:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the compute plane is shutting down")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.engine is not None
        return self.engine

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return (await self._engine(context)).describe()

    async def Reset(
        self, request: pb.ResetRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetResponse:
        await self._call((await self._engine(context)).reset)
        return pb.ResetResponse()

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.engine is not None
        return await self._call(self.engine.stats)

    async def Run(
        self, request_iterator: AsyncIterator[pb.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        engine = await self._engine(context)
        async for step in request_iterator:
            try:
                result = await self._call(engine.step, step)
            except StepRejected as e:
                log.warning("step %d rejected: %s", step.step_id, e)
                result = pb.StepResult(
                    step_id=step.step_id, error=pb.StepError(code=e.code, message=str(e))
                )
            except Exception as e:
                # State may be half-updated: drop it all; the control plane re-sends
                # its requests in full when it reattaches.
                log.exception("step %d failed", step.step_id)
                await self._call(engine.reset)
                await context.abort(grpc.StatusCode.INTERNAL, f"step {step.step_id} failed: {e}")
            result.draining = self.draining
            yield result

    async def drain(self, timeout: float) -> None:
        """Refuse new work and wait, up to `timeout` s, until no request is held."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.engine is not None and self.engine.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        held = len(self.engine.requests) if self.engine else 0
        log.info("compute plane drained (%d requests still held)", held)


async def serve(config: ComputeConfig) -> None:
    """Listen, load the model, mark SERVING, and run until SIGINT/SIGTERM."""
    from compute_plane.loader import load_model  # heavy imports after the port is bound
    from hetero_common.model_path import resolve_model_path

    server = grpc.aio.server()
    servicer = ComputeServicer()
    pb_grpc.add_ComputePlaneServicer_to_server(servicer, server)
    health = HealthReporter(server, SERVICE_NAME)
    await health.set(False)
    address = f"{config.host}:{config.port}"
    config.tls.add_port(server, address)
    if config.metrics_port:
        prometheus_client.start_http_server(config.metrics_port, addr=config.host)
    await server.start()
    log.info("compute plane listening on %s; loading %s", address, config.model)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def load() -> Engine:
        started = time.perf_counter()
        if config.num_threads:
            import torch

            torch.set_num_threads(config.num_threads)
        engine = Engine(config, load_model(resolve_model_path(config.model), progress=True))
        engine.warmup()
        metrics.model_load_seconds.labels(model_name=engine.model_name).set(
            time.perf_counter() - started
        )
        return engine

    load_task: asyncio.Future[Engine] = loop.run_in_executor(servicer.executor, load)
    stop_task: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    waiting: list[asyncio.Future[Any]] = [load_task, stop_task]
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    try:
        if load_task in done:
            servicer.engine = load_task.result()  # a load error propagates: one clear message
            d = servicer.engine.describe()
            await health.set(True)
            log.info(
                "compute plane ready on %s: %s, %d KV blocks of %d tokens, max_model_len %d",
                address,
                d.model_name,
                d.num_kv_blocks,
                d.block_size,
                d.max_model_len,
            )
            await stop.wait()
            log.info("compute plane draining for up to %.0f s", config.drain_timeout)
            await health.set(False)
            await servicer.drain(config.drain_timeout)
    finally:
        log.info("compute plane shutting down")
        stop_task.cancel()
        await server.stop(grace=1)
        servicer.executor.shutdown(wait=False, cancel_futures=True)
