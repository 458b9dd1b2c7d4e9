"""gRPC server of the compute plane: ComputePlane service, grpc.health.v1 and reflection.

The server listens at once and reports NOT_SERVING on health until the model is
loaded and warmed up; RPCs before that get UNAVAILABLE. The engine is never entered
twice: its calls run one at a time, on one worker thread on a CPU (a step's launch
computes its forward there, and the event loop stays free for health checks meanwhile).
On CUDA (`--engine-thread`) a step of decodes only is launched and finished on the event
loop itself: such a launch only queues device work, and a hop to a worker and back, with
the two threads taking turns on the GIL, would cost host time the GPU waits for. The
wait for a step's samples before its result runs off the loop, on the waiter thread.
Steps with a prompt to compute (whose first ones may compile kernels for seconds) or
with proposals (verified and drafted with samples read on the host) still go to the
worker. A decode step can still wait on the loop, for at most the steps in flight, when a
penalised request needs the pending samples on the host first.

With overlapped steps (`--overlap-steps`, on by default on CUDA) a step is launched and
then finished (Engine.launch / finish): while step k computes on the device, the next
step, if it arrives first, is launched behind it before step k's result is made and sent.
Results go back in the order of their steps.

SIGTERM drains: health turns NOT_SERVING, new streams and Describe get UNAVAILABLE,
the open step stream keeps running with `draining` set on every result (so the control
plane sends no new requests), and the process exits once it holds no request, or
after --drain-timeout, ending the step stream with UNAVAILABLE (not leaving it open for
the gRPC server's stop grace).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc

from compute_plane import metrics, threads
from compute_plane.config import ComputeConfig
from compute_plane.device import use_device
from compute_plane.engine import Engine, Launched
from compute_plane.requests import StepRejected
from hetero_common.grpc_server import COMPUTE_STOPPED, GrpcPlane
from hetero_common.limits import LINK_MAX_MESSAGE_BYTES
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputePlane"].full_name


class ComputeServicer(pb_grpc.ComputePlaneServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.draining = False
        self.closing = False  # the server is stopping: the engine's threads are going
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Decode steps' engine calls on the event loop's thread instead (set once the
        # engine is loaded); either way one call at a time.
        self.inline = False
        self._entered = asyncio.Lock()
        # Waits for a launched step's samples while the engine thread may launch the next.
        self.waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="samples")
        # The control plane that drives this one: the peer of the open Run stream. Its
        # block pool owns this KV cache, so another control plane is refused until that
        # stream ends (a crashed control plane's connection closes, and so does it).
        self._driver: str | None = None
        self._driver_stream: object | None = None
        self._runs: set[asyncio.Task[Any]] = set()  # the open Run streams' handlers
        self._writing: set[asyncio.Task[Any]] = set()  # those paused while grpc writes
        self._drops: set[asyncio.Future[None]] = set()  # (asyncio keeps weak references)

    async def _claim(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse a control plane other than the one whose Run stream is open."""
        peer = context.peer()
        if self._driver is not None and self._driver != peer:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this compute plane is driven by another control plane ({self._driver})",
            )

    async def _engine(self, context: grpc.aio.ServicerContext) -> Engine:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the compute plane is shutting down")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.engine is not None
        return self.engine

    async def _call(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """An engine call, on the engine's worker thread, or `inline` on this one (the
        loop's); never two at once (a Stats or Reset waits for a launch on the worker)."""
        async with self._entered:
            if inline:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return (await self._engine(context)).describe()

    async def Reset(
        self, request: pb.ResetRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetResponse:
        engine = await self._engine(context)
        await self._claim(context)
        await self._call(engine.reset)
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
        await self._claim(context)
        stream = object()
        self._driver, self._driver_stream = context.peer(), stream
        log.info("driven by control plane %s", self._driver)
        task = asyncio.current_task()
        assert task is not None
        self._runs.add(task)
        try:
            async for result in self._steps(engine, request_iterator, context):
                self._writing.add(task)
                yield result  # (grpc writes it: end_runs must not cancel it there)
                self._writing.discard(task)
                if self.closing:  # end_runs came while it was written
                    await context.abort(grpc.StatusCode.UNAVAILABLE, COMPUTE_STOPPED)
        except asyncio.CancelledError:
            if not self.closing:  # (the peer went: grpc cancels the handler)
                raise
            # end_runs: a status now, not a call left open for the stop's grace
            await context.abort(grpc.StatusCode.UNAVAILABLE, COMPUTE_STOPPED)
        finally:
            self._runs.discard(task)
            self._writing.discard(task)
            if self._driver_stream is stream:
                self._driver = self._driver_stream = None
                if not self.closing:  # (closing: the process ends, nothing to drop for)
                    await self._drop_requests(engine)

    async def _drop_requests(self, engine: Engine) -> None:
        """Its control plane is gone or moved its requests elsewhere (a new one resets
        anyway): a drain need not wait for them. In a task of its own: when the peer
        vanished (a control plane killed) gRPC cancels the stream's handler right after
        the stream ends, which cancelled the drop with it and left the requests held
        until a drain timed out."""
        drop = asyncio.ensure_future(self._call(engine.drop_requests, "control plane gone"))
        self._drops.add(drop)
        drop.add_done_callback(self._drops.discard)
        await asyncio.shield(drop)

    async def _steps(
        self,
        engine: Engine,
        request_iterator: AsyncIterator[pb.StepRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StepResult]:
        if not engine.overlap:
            async for step in request_iterator:
                received = time.time_ns()
                try:
                    launched = await self._launch(engine, step)
                except Exception as e:
                    await self._failed(engine, step.step_id, e, context)
                yield await self._finish(engine, launched, received, context)
            return
        # Overlapped: read the stream into a queue, so that while a launched step computes
        # the next one can be launched as soon as it arrives.
        arrived: asyncio.Queue[tuple[pb.StepRequest, int] | None] = asyncio.Queue()

        broke: list[BaseException] = []

        async def read() -> None:
            try:
                async for step in request_iterator:
                    arrived.put_nowait((step, time.time_ns()))
            except Exception as e:  # the stream broke: finish what was launched, then raise
                broke.append(e)
            finally:
                arrived.put_nowait(None)

        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        pending: tuple[Launched | pb.StepResult, int] | None = None  # launched, received
        taken: list[tuple[pb.StepRequest, int] | None] = []  # an item read while racing
        got: asyncio.Future[tuple[pb.StepRequest, int] | None] | None = None
        try:
            while True:
                if pending is not None and not taken and arrived.empty():
                    # Step k computes: launch the next one if it comes first, else send
                    # k's result as soon as its samples are on the host.
                    launched = pending[0]
                    if isinstance(launched, Launched) and not launched.ready():
                        got = asyncio.ensure_future(arrived.get())
                        ready = loop.run_in_executor(self.waiter, launched.wait)
                        ready.add_done_callback(_retrieve)  # (finish raises it, if any)
                        await asyncio.wait((got, ready), return_when=asyncio.FIRST_COMPLETED)
                        if got.done():
                            taken.append(got.result())
                        got.cancel()
                    if not taken and arrived.empty():
                        yield await self._finish(engine, *pending, context)
                        pending = None
                        continue
                item = taken.pop() if taken else await arrived.get()
                if item is None:
                    break
                step, received = item
                try:
                    launched = await self._launch(engine, step)
                except Exception as e:
                    if pending is not None:  # its result first: it computed
                        yield await self._finish(engine, *pending, context)
                        pending = None
                    await self._failed(engine, step.step_id, e, context)
                if pending is not None:
                    yield await self._finish(engine, *pending, context)
                pending = (launched, received)
            if pending is not None:
                yield await self._finish(engine, *pending, context)
            if broke:
                raise broke[0]
        finally:
            reader.cancel()
            if got is not None:
                got.cancel()

    async def _launch(self, engine: Engine, step: pb.StepRequest) -> Launched | pb.StepResult:
        """The step launched, or its result when it was rejected (other errors raise)."""
        try:
            return await self._call(engine.launch, step, inline=self._inline(step))
        except StepRejected as e:
            log.warning("step %d rejected: %s", step.step_id, e)
            return pb.StepResult(
                step_id=step.step_id, error=pb.StepError(code=e.code, message=str(e))
            )

    async def _finish(
        self,
        engine: Engine,
        launched: Launched | pb.StepResult,
        received: int,
        context: grpc.aio.ServicerContext,
    ) -> pb.StepResult:
        if isinstance(launched, Launched):
            try:
                if self.inline and not launched.ready():  # (its wait off the loop)
                    await asyncio.get_running_loop().run_in_executor(self.waiter, launched.wait)
                result = await self._call(engine.finish, launched, inline=self.inline)
            except Exception as e:
                await self._failed(engine, launched.result.step_id, e, context)
                raise
        else:
            result = launched
        result.draining = self.draining
        result.received_unix_ns = received
        result.replied_unix_ns = time.time_ns()
        return result

    def _inline(self, step: pb.StepRequest) -> bool:
        """Whether to launch the step on the loop: inline mode and decodes only (no prompt
        tokens, no proposals)."""
        return (
            self.inline
            and not step.new_requests
            and not step.proposals
            and all(c.num_scheduled_tokens == 1 for c in step.continuing)
        )

    async def _failed(
        self, engine: Engine, step_id: int, error: Exception, context: grpc.aio.ServicerContext
    ) -> NoReturn:
        """A step raised: state may be half-updated, so drop it all (the control plane
        re-sends its requests in full when it reattaches) and end the stream."""
        log.error("step %d failed", step_id, exc_info=error)
        await self._call(engine.reset, True)
        await context.abort(grpc.StatusCode.INTERNAL, f"step {step_id} failed: {error}")
        raise AssertionError("abort raises")

    def end_runs(self) -> None:
        """End the open Run streams now (the server stops): an idle control plane keeps
        its stream open, and the server's stop grace waited a second for it. A stream
        whose result grpc is writing ends itself once it is written: a cancel landing in
        grpc's write left the stream to the grace ('Cancelling all calls')."""
        self.closing = True  # (a Run stream cut by the stop drops nothing on the way)
        for task in self._runs:
            if task not in self._writing:
                task.cancel()

    def num_held(self) -> int:
        """Requests the engine holds for a control plane that drives it (what a drain
        waits for: without one, nothing will step them)."""
        if self.engine is None or self._driver is None:
            return 0
        return len(self.engine.requests)


async def serve(config: ComputeConfig) -> None:
    """Listen, load the model, mark SERVING, and run until SIGINT/SIGTERM; then drain."""
    plane = GrpcPlane(config, SERVICE_NAME, max_receive_bytes=LINK_MAX_MESSAGE_BYTES)
    servicer = ComputeServicer()
    pb_grpc.add_ComputePlaneServicer_to_server(servicer, plane.server)
    await plane.start()  # (NOT_SERVING until the model is loaded)
    log.info("compute plane listening on %s; loading %s", plane.address, config.model)
    loop = asyncio.get_running_loop()
    load = loop.run_in_executor(servicer.executor, _load_engine, config)
    try:
        if await plane.before_stop(load):
            servicer.engine = load.result()  # a load error propagates: one clear message
            mode = config.engine_thread
            on_cuda = servicer.engine.device.type == "cuda"
            servicer.inline = mode == "off" or (mode == "auto" and on_cuda)
            use_device(servicer.engine.device)  # for inline calls (the engine thread's is set)
            d = servicer.engine.describe()
            await plane.health.set(True)
            log.info(
                "compute plane ready on %s: %s, %d KV blocks of %d tokens, max_model_len %d; "
                "engine calls on %s",
                plane.address,
                d.model_name,
                d.num_kv_blocks,
                d.block_size,
                d.max_model_len,
                "the event loop" if servicer.inline else "a worker thread",
            )
            await plane.stopped()
            log.info("compute plane draining for up to %.0f s", config.drain_timeout)
            servicer.draining = True
            held = await plane.drain(servicer.num_held, config.drain_timeout)
            log.info("compute plane drained (%d requests still held)", held)
    finally:
        log.info("compute plane shutting down")
        servicer.end_runs()
        await plane.close()
        servicer.executor.shutdown(wait=False, cancel_futures=True)
        servicer.waiter.shutdown(wait=False, cancel_futures=True)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a waiter's exception as seen (the step's finish raises it again)."""
    if not future.cancelled():
        future.exception()


def _load_engine(config: ComputeConfig) -> Engine:
    """Load and warm up the model (on the servicer's worker thread)."""
    # heavy imports after the port is bound
    from compute_plane.engine import check_memory_before_loading, load_for
    from hetero_common.model_path import resolve_model_path

    started = time.perf_counter()
    threads.apply(config.num_threads or threads.usable_cpus())
    path = resolve_model_path(config.model)
    check_memory_before_loading(config, path)
    engine = Engine(config, load_for(config, path, progress=True))
    engine.warmup()
    metrics.model_load_seconds.labels(**engine.metric_labels).set(time.perf_counter() - started)
    return engine
