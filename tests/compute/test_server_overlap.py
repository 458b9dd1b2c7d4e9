"""The gRPC server's step loop with overlapped steps: the next step is launched when it
arrives before the running step's samples are on the host, else the running step's result
goes out first; results always go back in step order.

The engine is a stand-in that logs launch/finish calls and whose steps finish when the
test opens their gate (the real engine's launch/finish are tested in test_overlap.py and
end to end in tests/e2e/test_async_scheduling.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from compute_plane.engine import Launched
from compute_plane.requests import StepRejected
from compute_plane.server import ComputeServicer
from hetero_proto import compute_pb2 as pb
from tests.grpc_context import Aborted, Context


class Gate:
    """Stands in for a step's DeviceSamples: ready once the test opens it."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def ready(self) -> bool:
        return self.open.is_set()

    def wait(self) -> None:
        assert self.open.wait(10), "a step's samples never came"


class StubEngine:
    overlap = True

    def __init__(self, reject: int | None = None, crash: int | None = None) -> None:
        self.log: list[str] = []
        self.gates: dict[int, Gate] = {}
        self.reject, self.crash = reject, crash

    def launch(self, step: pb.StepRequest) -> Launched:
        if step.step_id == self.reject:
            raise StepRejected("bad step")
        if step.step_id == self.crash:
            raise RuntimeError("boom")
        self.log.append(f"launch {step.step_id}")
        gate = self.gates.setdefault(step.step_id, Gate())
        return Launched(pb.StepResult(step_id=step.step_id), samples=gate)  # type: ignore[arg-type]

    def finish(self, launched: Launched) -> pb.StepResult:
        assert launched.samples is not None
        launched.samples.wait()
        self.log.append(f"finish {launched.result.step_id}")
        return launched.result

    def reset(self, failed: bool = False) -> None:
        self.log.append("reset")


@pytest.fixture(params=[False, True], ids=["worker-thread", "event-loop"])
def inline(request: pytest.FixtureRequest) -> bool:
    """The engine's calls on the server's worker thread, or on its event loop (as on CUDA
    by default, `--engine-thread`): the same order of launches, finishes and results."""
    return bool(request.param)


async def _drive(
    engine: StubEngine, script: list[tuple[str, Any]], inline: bool
) -> tuple[list[pb.StepResult], list[str]]:
    """Feed steps and open gates as the script says ("send", id) / ("open", id) /
    ("sleep", s) / ("await result", id: wait until that step's result is out)."""
    servicer = ComputeServicer()
    servicer.inline = inline
    results: list[pb.StepResult] = []
    got = asyncio.Condition()

    async def steps() -> AsyncIterator[pb.StepRequest]:
        for what, arg in script:
            if what == "send":
                yield pb.StepRequest(step_id=arg)
            elif what == "open":
                engine.gates.setdefault(arg, Gate()).open.set()
            elif what == "sleep":
                await asyncio.sleep(arg)
            elif what == "await result":
                async with got:
                    await asyncio.wait_for(
                        got.wait_for(lambda a=arg: any(r.step_id == a for r in results)), 10
                    )

    async def consume() -> None:
        async for r in servicer._steps(engine, steps(), Context()):  # type: ignore[arg-type]
            async with got:
                results.append(r)
                got.notify_all()

    try:
        await asyncio.wait_for(consume(), 20)
    except Aborted as e:
        engine.log.append(f"aborted: {e}")
    servicer.executor.shutdown()
    servicer.waiter.shutdown()
    return results, engine.log


def test_a_step_that_arrives_while_the_last_computes_is_launched_behind_it(inline: bool) -> None:
    engine = StubEngine()
    script = [("send", 1), ("sleep", 0.2), ("send", 2), ("sleep", 0.2), ("open", 1), ("open", 2)]
    results, log = asyncio.run(_drive(engine, script, inline))
    assert [r.step_id for r in results] == [1, 2]
    assert log == ["launch 1", "launch 2", "finish 1", "finish 2"]


def test_queued_steps_are_launched_before_the_result_of_the_one_before(inline: bool) -> None:
    engine = StubEngine()
    script = [("open", 1), ("open", 2), ("open", 3), ("send", 1), ("send", 2), ("send", 3)]
    results, log = asyncio.run(_drive(engine, script, inline))
    assert [r.step_id for r in results] == [1, 2, 3]
    assert log == ["launch 1", "launch 2", "finish 1", "launch 3", "finish 2", "finish 3"]


def test_a_result_goes_out_when_its_samples_come_before_the_next_step(inline: bool) -> None:
    """The control plane waits for step 1's result before it sends step 2 (nothing
    planned ahead): the server must send it without a next step to launch."""
    engine = StubEngine()
    script = [("send", 1), ("sleep", 0.1), ("open", 1), ("await result", 1), ("open", 2)]
    script += [("send", 2)]
    results, log = asyncio.run(_drive(engine, script, inline))
    assert [r.step_id for r in results] == [1, 2]
    assert log == ["launch 1", "finish 1", "launch 2", "finish 2"]


@pytest.mark.parametrize("gates_open", [True, False])
def test_a_rejected_step_answers_in_its_place(gates_open: bool, inline: bool) -> None:
    engine = StubEngine(reject=2)
    script: list[tuple[str, Any]] = [("send", 1), ("send", 2), ("send", 3)]
    script += [("sleep", 0.1), ("open", 1), ("open", 3)]
    if gates_open:
        script = script[3:] + script[:3]
    results, log = asyncio.run(_drive(engine, script, inline))
    assert [r.step_id for r in results] == [1, 2, 3]
    assert results[1].error.message == "bad step" and not results[0].HasField("error")
    assert log[0] == "launch 1" and log.index("finish 1") < log.index("launch 3")


def test_a_step_that_raises_at_launch_lets_the_one_before_answer_first(inline: bool) -> None:
    """Step 1 computed: its result goes back before the stream ends on step 2's error."""
    engine = StubEngine(crash=2)
    script = [("send", 1), ("send", 2), ("sleep", 0.1), ("open", 1)]
    results, log = asyncio.run(_drive(engine, script, inline))
    assert [r.step_id for r in results] == [1]
    assert log == ["launch 1", "finish 1", "reset", "aborted: step 2 failed: boom"]


def test_on_the_event_loop_only_steps_of_decodes_are_launched() -> None:
    """A step with prompt tokens (a first one may compile kernels for seconds) or with
    proposals (read on the host) goes to the worker thread; decodes stay on the loop."""
    servicer = ComputeServicer()
    servicer.inline = True
    decodes = pb.StepRequest(step_id=1, decode_ids=["a", "b"])
    decodes.continuing.add(request_id="c", num_scheduled_tokens=1, new_block_ids=[7])
    assert servicer._inline(decodes)
    chunk = pb.StepRequest(step_id=2, decode_ids=["a"])
    chunk.continuing.add(request_id="c", num_scheduled_tokens=16)
    new = pb.StepRequest(step_id=3, decode_ids=["a"])
    new.new_requests.add(request_id="d", token_ids=[1, 2, 3], num_scheduled_tokens=3)
    proposed = pb.StepRequest(step_id=4, decode_ids=["a"])
    proposed.proposals.add(request_id="a", token_ids=[5, 6])
    assert not any(servicer._inline(s) for s in (chunk, new, proposed))
    servicer.inline = False
    assert not servicer._inline(decodes)
    servicer.executor.shutdown()
    servicer.waiter.shutdown()


class Peer(Context):
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


@pytest.mark.parametrize("closing", [False, True], ids=["stream-ended", "server-stopping"])
def test_a_run_stream_that_ends_drops_its_requests_unless_the_server_stops(closing: bool) -> None:
    """A Run stream that ends (its control plane gone) drops the requests it held; one cut
    by the server's own stop does not try, as the engine's threads are shut down by then
    (the drop raised RuntimeError there: a traceback at each Ctrl-C on `serve`)."""
    engine = StubEngine()
    engine.drop_requests = lambda why: engine.log.append(f"drop: {why}")  # type: ignore[attr-defined]

    async def go() -> None:
        servicer = ComputeServicer()
        servicer.engine = engine  # type: ignore[assignment]
        servicer.closing = closing
        if closing:
            servicer.executor.shutdown()

        async def no_steps() -> AsyncIterator[pb.StepRequest]:
            return
            yield

        async for _ in servicer.Run(no_steps(), Peer()):  # type: ignore[arg-type]
            pass
        servicer.executor.shutdown()
        servicer.waiter.shutdown()

    asyncio.run(go())
    assert engine.log == ([] if closing else ["drop: control plane gone"])


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_stopping_server_ends_a_run_paused_at_its_write(overlap: bool) -> None:
    """end_runs (the server stops, drained) while a Run stream is paused at a result's
    yield, as it is while grpc writes that result: the stream ends with UNAVAILABLE 'the
    compute plane stopped' when it resumes (what the control plane reads as a planned
    stop). end_runs cancelled the handler's task, and a cancel landing in grpc's write
    left the stream to the server's 1 s stop grace ('Cancelling all calls'), which the
    control plane logged as a lost compute plane."""
    from hetero_common.grpc_server import COMPUTE_STOPPED

    engine = StubEngine()
    engine.overlap = overlap
    engine.drop_requests = lambda why: engine.log.append(f"drop: {why}")  # type: ignore[attr-defined]

    async def go() -> None:
        servicer = ComputeServicer()
        servicer.engine = engine  # type: ignore[assignment]
        engine.gates[1] = Gate()
        engine.gates[1].open.set()
        never = asyncio.Event()

        async def steps() -> AsyncIterator[pb.StepRequest]:
            yield pb.StepRequest(step_id=1)
            await never.wait()  # the control plane keeps its stream open

        run = servicer.Run(steps(), Peer())  # type: ignore[arg-type]
        first = await asyncio.wait_for(anext(run), 5)  # paused at this result's yield
        assert first.step_id == 1
        servicer.end_runs()
        with pytest.raises(Aborted, match=COMPUTE_STOPPED):
            await asyncio.wait_for(anext(run), 5)
        servicer.executor.shutdown()
        servicer.waiter.shutdown()

    asyncio.run(go())
    assert engine.log == ["launch 1", "finish 1"]
