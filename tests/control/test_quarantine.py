"""The control engine against a compute engine that dies whenever one request reaches it:
that request is failed after its second crash, and every other request finishes with the
tokens it gets when nothing crashes (the bundled model, greedy)."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from control_plane.compute_client import ComputeLinkError, InProcessLink
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine, RequestFailed
from control_plane.tokenizer import load_tokenizer
from hetero_common.accumulate import Accumulated
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb
from tests.control.streams import stream_tokens

PROMPTS = {"a": [504, 3458, 281], "b": [1812, 314, 253, 3360, 28], "c": [2710, 42, 33, 17]}
POISON = [9, 8, 7, 6]
PARAMS = pb.GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def _run(
    path: Path, poison: bool, stops: bool = False
) -> tuple[dict[str, list[int] | BaseException], int]:
    engine = Engine(
        ComputeConfig(model=str(path), kv_cache_bytes=16 << 20, metrics_port=-1),
        load_model(path, progress=False),
    )
    crashes = 0

    def answer(step: cpb.StepRequest) -> cpb.StepResult:
        nonlocal crashes
        if any(n.request_id.startswith("poison") for n in step.new_requests):
            crashes += 1
            engine.reset(failed=True)
            if stops:  # as a plane stopped by SIGTERM whose drain timed out looks
                if crashes <= 3:
                    stopped = "compute plane x: UNAVAILABLE: the compute plane stopped"
                    raise ComputeLinkError(stopped, "UNAVAILABLE", stopped=True)
                return engine.step(step)
            raise ComputeLinkError("the compute plane died")  # as a crashed process looks
        return engine.step(step)

    link = InProcessLink(engine.describe, answer, on_attach=engine.reset)
    control = ControlEngine(
        ControlConfig(model=str(path), metrics_port=-1), load_tokenizer(path), link
    )
    await control.start()
    try:
        await control.attached.wait()
        streams = {"a": control.submit(PROMPTS["a"], PARAMS, request_id="a")}
        await asyncio.sleep(0.05)  # "a" is running when the others come
        for rid in ("b", "c"):
            streams[rid] = control.submit(PROMPTS[rid], PARAMS, request_id=rid)
        if poison:
            streams["poison"] = control.submit(POISON, PARAMS, request_id="poison")
        results = dict(
            zip(
                streams,
                await asyncio.gather(
                    *map(functools.partial(stream_tokens, errors=True), streams.values())
                ),
                strict=True,
            )
        )
        return results, crashes
    finally:
        await control.stop()


@pytest.mark.timeout(300)
def test_a_request_that_crashes_the_compute_plane_twice_is_failed(smollm2_path: Path) -> None:
    clean, _ = asyncio.run(_run(smollm2_path, poison=False))
    got, crashes = asyncio.run(_run(smollm2_path, poison=True))
    failed = got.pop("poison")
    assert isinstance(failed, RequestFailed) and failed.code == "INTERNAL", failed
    assert "2 times in a row" in str(failed)
    assert crashes == 2
    assert got == clean  # the others finish, their tokens unchanged
    assert all(isinstance(v, list) and len(v) == 8 for v in clean.values())


@pytest.mark.timeout(300)
def test_a_request_in_flight_at_planned_stops_is_not_failed(smollm2_path: Path) -> None:
    """The compute plane stops (SIGTERM, its drain timed out) three times with a request in
    flight: a planned stop is no crash, so the request is re-sent each time and finishes
    with the tokens it gets when nothing stops (it was failed at the second stop, 'the
    compute plane failed 2 times in a row', as a request that crashes it)."""
    clean, _ = asyncio.run(_run(smollm2_path, poison=False))
    got, stops = asyncio.run(_run(smollm2_path, poison=True, stops=True))
    assert stops == 4  # three stops, then the fourth try computes it
    done = got.pop("poison")
    assert isinstance(done, list) and len(done) == 8, done
    assert got == clean


@pytest.mark.timeout(300)
def test_a_step_loop_that_fails_fails_its_requests_and_starts_afresh(
    smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the control plane's step loop (here: emitting a step's tokens raises once)
    fails every request it was running with INTERNAL and a log line, instead of leaving
    them waiting on a loop that is gone: one still running, and one that step finished
    (out of the scheduler, its last token not yet emitted). The plane attaches again and
    serves the next request with the tokens it gets when nothing fails."""

    async def run() -> tuple[list[BaseException | list[int]], list[int] | BaseException, list[int]]:
        engine = Engine(
            ComputeConfig(model=str(smollm2_path), kv_cache_bytes=16 << 20, metrics_port=-1),
            load_model(smollm2_path, progress=False),
        )
        link = InProcessLink(engine.describe, engine.step, on_attach=engine.reset)
        config = ControlConfig(model=str(smollm2_path), metrics_port=-1)
        control = ControlEngine(config, load_tokenizer(smollm2_path), link)
        await control.start()
        try:
            await control.attached.wait()
            clean = await stream_tokens(control.submit(PROMPTS["b"], PARAMS))
            [plane] = control.planes.values()
            emit = plane._emit

            def broken(*args: object) -> None:
                plane._emit = emit  # type: ignore[method-assign]
                raise RuntimeError("a bug")

            plane._emit = broken  # type: ignore[method-assign]
            one = pb.GenerationParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            streams = [control.submit(PROMPTS["a"], PARAMS), control.submit(PROMPTS["c"], one)]
            failed = [await stream_tokens(s, errors=True) for s in streams]
            await asyncio.wait_for(control.attached.wait(), 30)
            again = await stream_tokens(control.submit(PROMPTS["b"], PARAMS), errors=True)
            return failed, again, clean  # type: ignore[return-value]
        finally:
            await control.stop()

    failed, again, clean = asyncio.run(asyncio.wait_for(run(), 120))
    for error in failed:
        assert isinstance(error, RequestFailed) and error.code == "INTERNAL", error
        assert "the control plane failed while running this request" in str(error)
    assert again == clean and len(clean) == 8
    assert "the step loop failed" in caplog.text


class _Plane(InProcessLink):
    """An in-process compute plane that is down (its steps fail, health checks say so,
    attaching fails) while its address is in `down`."""

    def __init__(self, address: str, engine: Engine, down: set[str], crashes: list[str]) -> None:
        def answer(step: cpb.StepRequest) -> cpb.StepResult:
            if address in down:
                raise ComputeLinkError(f"{address} died")
            if any(n.request_id.startswith("poison") for n in step.new_requests):
                crashes.append(address)
                raise ComputeLinkError(f"{address} died")  # (and comes back)
            return engine.step(step)

        def describe() -> cpb.DescribeResponse:
            if address in down:
                raise ComputeLinkError(f"{address} is down")
            engine.reset()
            return engine.describe()

        super().__init__(describe, answer)
        self.address = address  # type: ignore[misc]
        self._down = down

    async def alive(self, timeout: float = 2.0) -> bool:
        return self.address not in self._down


async def _two_planes(path: Path, down: set[str], crashes: list[str]) -> ControlEngine:
    """A control engine driving two in-process compute planes, attached."""
    config = ControlConfig(model=str(path), metrics_port=-1, compute_timeout=60)
    control = ControlEngine(config, load_tokenizer(path))
    for address in ("a:1", "b:1"):
        engine = Engine(
            ComputeConfig(model=str(path), kv_cache_bytes=16 << 20, metrics_port=-1),
            load_model(path, progress=False),
        )
        control._add_plane(_Plane(address, engine, down, crashes))
    for plane in control.planes.values():
        await asyncio.wait_for(plane.attached.wait(), 30)
    return control


@pytest.mark.timeout(300)
def test_a_request_lost_with_two_planes_in_one_outage_is_not_failed(smollm2_path: Path) -> None:
    """Both compute planes die at the same moment, one idle, the other running a request:
    the request moves to the idle one, already dead too. That is one outage, not a request
    that crashed two planes: once they are back it finishes with the tokens it gets when
    nothing fails (it was failed: 'the compute plane failed 2 times in a row')."""

    async def run() -> tuple[list[int] | BaseException, list[int] | BaseException]:
        down: set[str] = set()
        control = await _two_planes(smollm2_path, down, [])
        try:
            clean = await stream_tokens(control.submit(PROMPTS["a"], PARAMS))
            stream = control.submit(PROMPTS["a"], PARAMS)
            acc = Accumulated()
            acc.add(first := await stream.queue.get())  # running: its first token is out
            assert not isinstance(first, BaseException), first
            down.update(control.planes)  # both at once
            await asyncio.sleep(1.5)  # both noticed (the idle one by its health checks)
            down.clear()
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    return clean, item
                if acc.add(item):
                    return clean, acc.choice(0).token_ids
        finally:
            await control.stop()

    clean, got = asyncio.run(asyncio.wait_for(run(), 120))
    assert not isinstance(got, BaseException), got
    assert got == clean


@pytest.mark.timeout(300)
def test_a_request_that_crashes_each_of_two_planes_is_failed(smollm2_path: Path) -> None:
    """A request that crashes whichever compute plane computes it, with two: it moves to
    the other after the first crash and is failed after the second; a request running
    meanwhile finishes with its tokens."""

    async def run() -> tuple[list[int] | BaseException, list[int] | BaseException, list[str]]:
        crashes: list[str] = []
        control = await _two_planes(smollm2_path, set(), crashes)
        try:
            clean = await stream_tokens(control.submit(PROMPTS["b"], PARAMS))
            other = control.submit(PROMPTS["b"], PARAMS)
            poison = control.submit(POISON, PARAMS, request_id="poison")
            failed = await stream_tokens(poison, errors=True)
            got = await stream_tokens(other, errors=True)
            assert got == clean, (got, clean)
            return failed, got, crashes
        finally:
            await control.stop()

    failed, _, crashes = asyncio.run(asyncio.wait_for(run(), 120))
    assert isinstance(failed, RequestFailed) and "2 times in a row" in str(failed), failed
    assert sorted(crashes) == ["a:1", "b:1"], crashes
