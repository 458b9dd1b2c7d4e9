"""--async-scheduling left unset: on for a compute plane that runs on a GPU in another
process, off on a CPU or in this process. The step loop against the bundled model's
compute engine behind a link that says which device and process it is: counted by the
steps sent while another was still unanswered, with the greedy tokens unchanged."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from control_plane.compute_client import InProcessLink
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.plane import plans_ahead
from control_plane.tokenizer import load_tokenizer
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb
from tests.control.streams import stream_tokens

PROMPTS = [[504, 3458, 281], [1812, 314, 253, 3360, 28], [2710, 42, 33, 17]]
PARAMS = pb.GenerationParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class _Link(InProcessLink):
    """The engine in this process, described as running on `device`, `concurrent` or not;
    counts the steps that found a later step already sent (planned ahead of its result)."""

    def __init__(self, engine: Engine, device: str, concurrent: bool) -> None:
        def describe() -> cpb.DescribeResponse:
            d = engine.describe()
            d.device = device
            return d

        super().__init__(describe, self._answer, on_attach=engine.reset)
        self.engine, self.concurrent = engine, concurrent
        self.behind = 0

    def _answer(self, step: cpb.StepRequest) -> cpb.StepResult:
        self.behind += bool(self._sent)  # receive() took this step; another waits behind it
        return self.engine.step(step)


async def _run(path: Path, setting: bool | None, device: str, concurrent: bool):  # type: ignore[no-untyped-def]
    engine = Engine(
        ComputeConfig(model=str(path), kv_cache_bytes=16 << 20, metrics_port=-1),
        load_model(path, progress=False),
    )
    link = _Link(engine, device, concurrent)
    config = ControlConfig(model=str(path), metrics_port=-1, async_scheduling=setting)
    control = ControlEngine(config, load_tokenizer(path), link)
    await control.start()
    try:
        await control.attached.wait()
        streams = [control.submit(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        tokens = await asyncio.gather(*map(stream_tokens, streams))
        for plane in control.planes.values():  # nothing kept per step beyond those in flight
            assert len(plane._marks) == len(plane._in_flight) <= 2
        return tokens, link.behind
    finally:
        await control.stop()


@pytest.mark.timeout(300)
def test_unset_async_scheduling_is_on_for_a_gpu_in_another_process(smollm2_path: Path) -> None:
    runs = {
        (setting, device, concurrent): asyncio.run(_run(smollm2_path, setting, device, concurrent))
        for setting, device, concurrent in [
            (None, "cpu", True),
            (None, "cuda:0", True),
            (None, "cuda:0", False),  # an in-process engine: nothing would overlap
            (False, "cuda:0", True),
            (True, "cpu", True),
        ]
    }
    expected = runs[(None, "cpu", True)][0]
    assert all(len(t) == PARAMS.max_tokens for t in expected)
    behind = {key: n for key, (tokens, n) in runs.items()}
    assert all(tokens == expected for tokens, _ in runs.values()), "greedy tokens changed"
    assert behind[(None, "cuda:0", True)] >= PARAMS.max_tokens // 2, behind
    assert behind[(True, "cpu", True)] >= PARAMS.max_tokens // 2, behind
    assert behind[(None, "cpu", True)] == behind[(None, "cuda:0", False)] == 0, behind
    assert behind[(False, "cuda:0", True)] == 0, behind


def test_plans_ahead() -> None:
    assert plans_ahead(None, "cuda:1", True) and not plans_ahead(None, "cuda", False)
    assert not plans_ahead(None, "cpu", True) and plans_ahead(True, "cpu", False)
    assert not plans_ahead(False, "cuda:0", True)
