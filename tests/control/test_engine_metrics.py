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
from control_plane.compute_client import InProcessLink
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.scheduler import AdmissionError, QueueFullError
from control_plane.tokenizer import load_tokenizer
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


@pytest.mark.timeout(120)
def test_a_refused_request_is_not_counted_as_routed(smollm2_path: Path) -> None:
    async def main() -> None:
        engine = Engine(
            ComputeConfig(model=str(smollm2_path), kv_cache_bytes=16 << 20, metrics_port=-1),
            load_model(smollm2_path, progress=False),
        )
        link = InProcessLink(engine.describe, engine.step, on_attach=engine.reset)
        config = ControlConfig(model=str(smollm2_path), metrics_port=-1, max_waiting=1)
        control = ControlEngine(config, load_tokenizer(smollm2_path), link)
        await control.start()
        try:
            await control.attached.wait()
            before = _routed()
            too_long = [504] * (engine.describe().max_model_len + 1)
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
