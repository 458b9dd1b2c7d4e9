"""The control engine's counters against what it did: a request refused at admission
(too long, over max_tokens, a full waiting queue) was placed on no compute plane."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from control_plane.compute_client import ComputeLinkError, InProcessLink
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine, RequestFailed
from control_plane.scheduler import AdmissionError, QueueFullError
from control_plane.tokenizer import load_tokenizer
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb
from tests.control.streams import stream_tokens

PARAMS = pb.GenerationParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _routed() -> float:
    return sum(
        s.value
        for metric in REGISTRY.collect()
        if metric.name == "hetero_routed_requests"
        for s in metric.samples
        if s.name == "hetero_routed_requests_total"
    )


def _on_the_bundled_model(
    smollm2_path: Path, model_name: str = "unknown", **control: object
) -> tuple[ControlEngine, InProcessLink]:
    """A control engine (not started) driving the bundled model's compute engine in this
    process, with `control` set in its ControlConfig."""
    engine = Engine(
        ComputeConfig(model=str(smollm2_path), kv_cache_bytes=16 << 20, metrics_port=-1),
        load_model(smollm2_path, progress=False),
    )
    link = InProcessLink(engine.describe, engine.step, on_attach=engine.reset)
    config = ControlConfig(model=str(smollm2_path), metrics_port=-1, **control)  # type: ignore[arg-type]
    return ControlEngine(config, load_tokenizer(smollm2_path), link, model_name), link


@pytest.mark.timeout(120)
def test_a_refused_request_is_not_counted_as_routed(smollm2_path: Path) -> None:
    async def main() -> None:
        control, _ = _on_the_bundled_model(smollm2_path, max_waiting=1)
        await control.start()
        try:
            await control.attached.wait()
            before = _routed()
            too_long = [504] * (control.plane.description.max_model_len + 1)  # type: ignore[union-attr]
            with pytest.raises(AdmissionError):
                control.submit(too_long, PARAMS)
            with pytest.raises(AdmissionError):
                control.submit([504, 3458], pb.GenerationParams(max_tokens=1 << 30))
            assert _routed() == before
            stream = control.submit([504, 3458, 281], PARAMS)  # (waits until a step)
            with pytest.raises(QueueFullError):
                control.submit([504, 3458, 281], PARAMS)
            assert _routed() == before + 1
            assert len(await stream_tokens(stream)) == 4  # type: ignore[arg-type]
        finally:
            await control.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_counters_read_zero_before_their_first_event(smollm2_path: Path, tmp_path: Path) -> None:
    """Counters whose labels are known exist at 0 from the start (a series that appears
    at 1 loses its first event to rate() and increase(): the first preemption, reset or
    failed request, and a hit rate with no hit yet read 'no data'), and so do the request
    histograms (the end-to-end, queue, prefill and decode ones appeared at the first
    finished request, the compute plane's step ones at its first step: rate() of their
    _count and buckets missed it)."""
    from tests.conftest import make_tiny_model

    tiny = tmp_path / "zero-start-tiny"
    make_tiny_model("llama", tiny)
    compute = Engine(
        ComputeConfig(model=str(tiny), kv_cache_bytes=4 << 20, metrics_port=-1),
        load_model(tiny, progress=False),
    )
    m = compute.metric_labels
    assert REGISTRY.get_sample_value("hetero_compute_engine_resets_total", m) == 0
    for code in ("INVALID_ARGUMENT", "INTERNAL"):
        labels = {"code": code, **m}
        assert REGISTRY.get_sample_value("hetero_compute_failed_requests_total", labels) == 0
    for kind in ("prefill", "decode", "mixed"):
        labels = {"kind": kind, **m}
        assert REGISTRY.get_sample_value("hetero_compute_step_duration_seconds_count", labels) == 0
    for name in ("tokens_per_step", "seqs_per_step"):
        assert REGISTRY.get_sample_value(f"hetero_compute_{name}_count", m) == 0, name

    async def main() -> None:
        control, link = _on_the_bundled_model(smollm2_path, "zero-start")
        await control.start()
        try:
            await control.attached.wait()
            labels = {"model_name": "zero-start"}
            assert REGISTRY.get_sample_value("hetero_prompt_tokens_total", labels) == 0
            for reason in ("stop", "length", "abort", "grammar", "error"):
                value = REGISTRY.get_sample_value(
                    "hetero_request_success_total", {"finished_reason": reason, **labels}
                )
                assert value == 0, reason
            for name in (
                "time_to_first_token_seconds", "inter_token_latency_seconds",
                "e2e_request_latency_seconds", "request_queue_time_seconds",
                "request_prefill_time_seconds", "request_decode_time_seconds",
            ):  # fmt: skip
                assert REGISTRY.get_sample_value(f"hetero_{name}_count", labels) == 0, name
            labels["compute"] = link.address
            for name in ("preemptions", "prefix_cache_queries", "prefix_cache_hits"):
                assert REGISTRY.get_sample_value(f"hetero_{name}_total", labels) == 0, name
        finally:
            await control.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_failed_requests_held_back_tokens_count_as_generated(smollm2_path: Path) -> None:
    """A request that fails mid-stream (here: in flight each of the 2 times the compute
    plane crashed) counts every token it generated in hetero_generation_tokens_total, as
    an aborted one does: those --stream-interval still held back were not counted."""

    async def main() -> None:
        engine = Engine(
            ComputeConfig(model=str(smollm2_path), kv_cache_bytes=16 << 20, metrics_port=-1),
            load_model(smollm2_path, progress=False),
        )
        crashing = False

        def answer(step: cpb.StepRequest) -> cpb.StepResult:
            if crashing:
                engine.reset(failed=True)
                raise ComputeLinkError("the compute plane died")  # as a crashed process looks
            return engine.step(step)

        link = InProcessLink(engine.describe, answer, on_attach=engine.reset)
        config = ControlConfig(model=str(smollm2_path), metrics_port=-1, stream_interval=8)
        control = ControlEngine(config, load_tokenizer(smollm2_path), link, "held-back-failed")
        await control.start()
        labels = {"model_name": "held-back-failed"}
        try:
            await control.attached.wait()
            long = pb.GenerationParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = control.submit([504, 3458, 281], long)
            choice = stream.choices[0]
            while len(choice.pending) < 3:  # the first token sent, the next ones held
                await asyncio.sleep(0.005)
            crashing = True
            sent = 0
            while not isinstance(item := await stream.queue.get(), BaseException):
                sent += sum(len(c.token_ids) for c in item.choices)
            assert isinstance(item, RequestFailed), item
            generated = choice.request.num_output_tokens
            assert generated > sent  # some were held back when it failed
            counted = REGISTRY.get_sample_value("hetero_generation_tokens_total", labels)
            assert counted == generated
        finally:
            await control.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_failed_compute_planes_gauges_count_nothing_running(smollm2_path: Path) -> None:
    """A compute plane fails and its running request moves to the other: the failed one's
    running/waiting/KV gauges read 0 (they kept their last values, so a sum over the
    planes counted the moved request twice for as long as the plane stayed away)."""
    from tests.control.test_quarantine import _two_planes

    long = pb.GenerationParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    def gauge(name: str, address: str) -> float | None:
        labels = {"compute": address, "model_name": "unknown"}
        return REGISTRY.get_sample_value(f"hetero_{name}", labels)

    async def main() -> None:
        down: set[str] = set()
        control = await _two_planes(smollm2_path, down, [])
        try:
            stream = control.submit([504, 3458, 281], long)
            failed = next(a for a, p in control.planes.items() if p.load)
            link = control.planes[failed].client
            answer = link._answer  # type: ignore[attr-defined]
            seen: list[float | None] = []

            def dies_at_its_fifth_step(step: cpb.StepRequest) -> cpb.StepResult:
                seen.append(gauge("requests_running", failed))
                if len(seen) == 5:
                    down.add(failed)
                return answer(step)  # type: ignore[no-any-return]

            link._answer = dies_at_its_fifth_step  # type: ignore[attr-defined]
            assert isinstance(await stream_tokens(stream), list)  # finished on the other
            for name in ("requests_running", "requests_waiting", "kv_cache_usage_ratio"):
                assert gauge(name, failed) == 0, name
            assert seen[-1] == 1  # (before it failed)
        finally:
            await control.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_the_waiting_gauge_counts_a_request_when_it_is_placed_and_aborted(
    smollm2_path: Path,
) -> None:
    """hetero_requests_waiting was set after each step only: a request placed while a step
    ran (a CPU prefill can take seconds) was not counted until that step ended, nor one
    aborted from the queue uncounted. A scrape between two steps reads the queue as it is."""

    async def main() -> None:
        control, link = _on_the_bundled_model(smollm2_path, "waiting-now")
        await control.start()
        labels = {"model_name": "waiting-now", "compute": link.address}

        def waiting() -> float | None:
            return REGISTRY.get_sample_value("hetero_requests_waiting", labels)

        try:
            await control.attached.wait()
            assert waiting() == 0
            # (submit does not yield: no step runs between these lines)
            a = control.submit([504, 3458, 281], PARAMS)
            assert waiting() == 1
            b = control.submit([504, 3458, 282], PARAMS)
            assert waiting() == 2
            control.abort(b)
            assert waiting() == 1
            assert len(await stream_tokens(a)) == 4  # type: ignore[arg-type]
            assert waiting() == 0
        finally:
            await control.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_accepted_tokens_per_position_read_zero_before_the_first_acceptance(
    smollm2_path: Path,
) -> None:
    """Each of the k positions of a proposal is a known label once speculation is set up:
    its series exists at 0 (appearing at 1, its first acceptance was lost to rate())."""

    async def main() -> None:
        control, _ = _on_the_bundled_model(
            smollm2_path, "per-pos", speculative="ngram", num_speculative_tokens=3
        )
        await control.start()
        try:
            await control.attached.wait()
            for pos in range(4):
                value = REGISTRY.get_sample_value(
                    "hetero_spec_decode_num_accepted_tokens_per_pos_total",
                    {"model_name": "per-pos", "position": str(pos)},
                )
                assert value == (0 if pos < 3 else None), pos
        finally:
            await control.stop()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_an_aborted_requests_held_back_tokens_count_as_generated(smollm2_path: Path) -> None:
    """hetero_generation_tokens_total counts every token an aborted request generated, as
    with --stream-interval 1: those the interval still held back were not counted."""

    async def main() -> None:
        control, _ = _on_the_bundled_model(smollm2_path, "held-back", stream_interval=8)
        await control.start()
        labels = {"model_name": "held-back"}

        def generated() -> float:
            return REGISTRY.get_sample_value("hetero_generation_tokens_total", labels) or 0

        try:
            await control.attached.wait()
            long = pb.GenerationParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = control.submit([504, 3458, 281], long)
            choice = stream.choices[0]
            while len(choice.pending) < 3:  # the first token sent, the next ones held
                await asyncio.sleep(0.005)
            sent = 0
            while not stream.queue.empty():
                item = stream.queue.get_nowait()
                assert isinstance(item, pb.GenerateResponse)
                sent += sum(len(c.token_ids) for c in item.choices)
            held = len(choice.pending)
            control.abort(stream)
            await asyncio.sleep(0.5)  # the steps in flight end
            assert generated() == sent + held
        finally:
            await control.stop()

    asyncio.run(main())
