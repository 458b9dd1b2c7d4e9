"""The control plane's link to one compute plane: Describe, Reset, and the `Run` stream.

A compute plane is an object the scheduler loop talks to, not a global, so that
several can sit behind one control plane later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_common.grpc_server import COMPUTE_STOPPED
from hetero_common.limits import LINK_MAX_MESSAGE_BYTES
from hetero_common.tls import ClientTLS
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc


class ComputeLinkError(ConnectionError):
    """The compute plane is unreachable or its stream broke (`code`: the gRPC status
    name when an RPC failed, e.g. FAILED_PRECONDITION: another control plane drives it;
    `stopped`: the compute plane ended the stream itself as it stopped, drained)."""

    def __init__(self, message: str, code: str = "", stopped: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.stopped = stopped


def _rpc_error(address: str, code: grpc.StatusCode, details: str | None) -> ComputeLinkError:
    stopped = code == grpc.StatusCode.UNAVAILABLE and details == COMPUTE_STOPPED
    return ComputeLinkError(f"compute plane {address}: {code.name}: {details}", code.name, stopped)


class StepFailed(RuntimeError):
    """The compute plane rejected a step (a control-plane bug: steps are built here)."""

    def __init__(self, error: pb.StepError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.code = error.code


def sampled_tokens(result: pb.StepResult) -> dict[str, int]:
    """Request id -> the token it sampled in this step, in the result's order."""
    return dict(zip(result.sampled_ids, result.sampled_token_ids, strict=True))


class ComputeLink(Protocol):
    """What the control plane's step loop needs from a compute plane.

    ComputeClient speaks compute.proto over gRPC; hetero_infer.offline runs the compute
    engine in the same process for offline batch inference.
    """

    address: str
    # whether the compute plane runs a sent step while this process goes on (a separate
    # process); unset --async-scheduling plans ahead only over such a link
    concurrent: bool

    async def attach(
        self,
        timeout: float = 10.0,
        check: Callable[[pb.DescribeResponse], object] | None = None,
    ) -> pb.DescribeResponse:
        """Describe the compute plane, drop any state it holds, and open the step stream.
        `check` sees the description first: when it raises, the compute plane is left as
        it was (not reset, no stream opened: free for another control plane)."""
        ...

    async def alive(self, timeout: float = 2.0) -> bool | None:
        """True: it answered, up; False: it is down; None: no answer in time."""
        ...

    async def send(self, request: pb.StepRequest) -> None:
        """Send a step; `receive` returns its result. One step is in flight at a time."""
        ...

    async def receive(self) -> pb.StepResult: ...
    async def ended(self) -> ComputeLinkError:
        """Returns (not raises) why, once the step stream `attach` opened ends by itself
        (the compute plane stopped or died); never for a stream this side ended, nor for
        a link without a stream."""
        ...

    async def detach(self) -> None:
        """End the step stream `attach` opened (the compute plane is then free for
        another control plane); `attach` may be called again."""
        ...

    async def close(self) -> None: ...


class ComputeClient:
    concurrent = True

    def __init__(self, address: str, tls: ClientTLS | None = None, server_name: str = "") -> None:
        """`server_name`: the host name `address` was resolved from; TLS verifies the
        compute plane's certificate against it."""
        self.address = address
        tls = tls or ClientTLS()
        # A step's result may pass gRPC's default 4 MiB (prompt logprobs of a long
        # prefill): past it the Run stream would end (LINK_MAX_MESSAGE_BYTES).
        options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", LINK_MAX_MESSAGE_BYTES)
        ]
        if tls.enabled and server_name and server_name != address.rpartition(":")[0]:
            options.append(("grpc.ssl_target_name_override", server_name))
        self.channel = tls.aio_channel(address, options)
        self.stub = pb_grpc.ComputePlaneStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._run: grpc.aio.StreamStreamCall | None = None
        self._run_ended = asyncio.Event()  # set when the call `_run` is done

    async def attach(
        self,
        timeout: float = 10.0,
        check: Callable[[pb.DescribeResponse], object] | None = None,
    ) -> pb.DescribeResponse:
        with self._link_errors():
            description = await self.stub.Describe(pb.DescribeRequest(), timeout=timeout)
            if check is not None:
                check(description)
            await self.stub.Reset(pb.ResetRequest(), timeout=timeout)
        if self._run is not None:
            self._run.cancel()
        self._run = run = self.stub.Run()
        self._run_ended = ended = asyncio.Event()
        run.add_done_callback(lambda _: ended.set())
        return description

    async def alive(self, timeout: float = 2.0) -> bool | None:
        """False when the compute plane refuses connections; True when it answered; None
        when it did not answer in time (or failed the call otherwise): not a death, but
        no sign that it is up either.

        A slow answer is not a death: only UNAVAILABLE counts. Nor is NOT_SERVING: a
        loaded compute plane reports it only while it drains, finishing its requests, and
        its control plane may learn of the drain seconds later (`StepResult.draining`
        comes with the result of the step it is computing: a long prefill's).
        """
        try:
            await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return False if e.code() == grpc.StatusCode.UNAVAILABLE else None
        return True

    async def send(self, request: pb.StepRequest) -> None:
        """Send one step; its result comes from `receive`."""
        assert self._run is not None, "attach() first"
        with self._link_errors():
            try:
                await self._run.write(request)
            except asyncio.InvalidStateError as e:
                # The stream ended while nothing was in flight (the compute plane died
                # while idle): grpc refuses the write without its status, which is the
                # link's failure as any other (else the step loop died with it).
                raise await self._status(self._run) from e

    async def receive(self) -> pb.StepResult:
        """The result of the step sent last."""
        assert self._run is not None, "attach() first"
        with self._link_errors():
            result = await self._run.read()
        if result is grpc.aio.EOF:
            raise ComputeLinkError(f"compute plane {self.address} closed the step stream")
        assert isinstance(result, pb.StepResult)
        if result.HasField("error"):
            raise StepFailed(result.error)
        return result

    async def ended(self) -> ComputeLinkError:
        run = self._run
        assert run is not None, "attach() first"
        await self._run_ended.wait()  # (an Event: cancelling this wait leaves the call be)
        if run is not self._run:  # (ended by this side: detach, or attach again)
            await asyncio.Future()
        return await self._status(run)

    async def _status(self, run: grpc.aio.StreamStreamCall) -> ComputeLinkError:
        """The error of an ended step stream, naming the compute plane."""
        return _rpc_error(self.address, await run.code(), await run.details())

    @contextlib.contextmanager
    def _link_errors(self) -> Iterator[None]:
        """A failed RPC on the link becomes ComputeLinkError naming the plane."""
        try:
            yield
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(self.address, e.code(), e.details()) from e

    async def detach(self) -> None:
        if self._run is not None:
            self._run.cancel()
            self._run = None

    async def close(self) -> None:
        await self.detach()
        await self.channel.close()


class InProcessLink:
    """A ComputeLink to a compute engine in this process: a step is a function call.

    `describe` and `answer` are the engine's (the control plane imports no compute
    plane: the caller wires them). `on_attach` runs at each attach (e.g. a reset);
    with `wire`, steps and results round-trip through their serialised form, as over
    gRPC (the overhead benchmark measures that cost).
    """

    address = "in-process"
    concurrent = False  # a step runs inside receive()

    def __init__(
        self,
        describe: Callable[[], pb.DescribeResponse],
        answer: Callable[[pb.StepRequest], pb.StepResult],
        on_attach: Callable[[], object] | None = None,
        wire: bool = False,
    ) -> None:
        self._describe, self._answer, self._on_attach = describe, answer, on_attach
        self._wire = wire
        # (up to 1 + steps_ahead with async scheduling)
        self._sent: deque[pb.StepRequest] = deque()

    async def attach(
        self,
        timeout: float = 10.0,
        check: Callable[[pb.DescribeResponse], object] | None = None,
    ) -> pb.DescribeResponse:
        description = self._describe()
        if check is not None:
            check(description)
        self._sent.clear()  # (as a new Run stream: the old one's steps went with it)
        if self._on_attach is not None:
            self._on_attach()
        return description

    async def alive(self, timeout: float = 2.0) -> bool:
        return True

    async def send(self, request: pb.StepRequest) -> None:
        self._sent.append(
            pb.StepRequest.FromString(request.SerializeToString()) if self._wire else request
        )

    async def receive(self) -> pb.StepResult:
        """Runs the oldest step sent (a call in this process: nothing overlaps it)."""
        if not self._sent:
            raise RuntimeError("receive() before send()")
        # Let the loop's other tasks run between steps: without a suspension here the step
        # loop never yielded while it had work, so a cancelled caller (OfflineLLM's Ctrl-C)
        # was noticed only once every request had finished.
        await asyncio.sleep(0)
        request = self._sent.popleft()
        result = self._answer(request)
        return pb.StepResult.FromString(result.SerializeToString()) if self._wire else result

    async def ended(self) -> ComputeLinkError:
        await asyncio.Future()  # (no stream: a step is a call)
        raise AssertionError("unreachable")

    async def detach(self) -> None:
        self._sent.clear()

    async def close(self) -> None:
        return None
