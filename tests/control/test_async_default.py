"""--async-scheduling left unset: on for a compute plane that runs on a GPU in another
process, off on a CPU or in this process; --steps-ahead left unset: two steps planned
beyond the one awaited on a GPU, one else. The step loop against the bundled model's
compute engine behind a link that says which device and process it is: counted by the
steps sent while another was still unanswered, and the most unanswered at once, with the
greedy tokens unchanged."""

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
from control_plane.plane import plans_ahead, steps_ahead
from control_plane.tokenizer import TokenizerWrapper, load_tokenizer
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb
from tests.control.streams import stream_tokens

PROMPTS = [[504, 3458, 281], [1812, 314, 253, 3360, 28], [2710, 42, 33, 17]]
PARAMS = pb.GenerationParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class _Link(InProcessLink):
    """The engine in this process, described as running on `device`, `concurrent` or not;
    counts the steps that found a later step already sent (planned ahead of its result),
    and keeps the most steps sent and unanswered at once."""

    def __init__(self, engine: Engine, device: str, concurrent: bool) -> None:
        def describe() -> cpb.DescribeResponse:
            d = engine.describe()
            d.device = device
            return d

        super().__init__(describe, self._answer, on_attach=engine.reset)
        self.engine, self.concurrent = engine, concurrent
        self.behind = self.most = 0

    def _answer(self, step: cpb.StepRequest) -> cpb.StepResult:
        self.behind += bool(self._sent)  # receive() took this step; another waits behind it
        self.most = max(self.most, 1 + len(self._sent))
        return self.engine.step(step)


async def _run(
    path: Path,
    engine: Engine,
    tokenizer: TokenizerWrapper,
    setting: bool | None,
    device: str,
    concurrent: bool,
    ahead: int | None = None,
):
    link = _Link(engine, device, concurrent)  # attaching resets the engine
    config = ControlConfig(
        model=str(path), metrics_port=-1, async_scheduling=setting, steps_ahead=ahead
    )
    control = ControlEngine(config, tokenizer, link)
    await control.start()
    try:
        await control.attached.wait()
        streams = [control.submit(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        tokens = await asyncio.gather(*map(stream_tokens, streams))
        for plane in control.planes.values():  # nothing kept per step beyond those in flight
            assert len(plane._marks) == len(plane._in_flight) <= 4
        return tokens, link.behind, link.most
    finally:
        await control.stop()


@pytest.mark.timeout(300)
def test_unset_async_scheduling_is_on_for_a_gpu_in_another_process(smollm2_path: Path) -> None:
    engine = Engine(
        ComputeConfig(model=str(smollm2_path), kv_cache_bytes=16 << 20, metrics_port=-1),
        load_model(smollm2_path, progress=False),
    )
    tokenizer = load_tokenizer(smollm2_path)
    runs = {
        (setting, device, concurrent, ahead): asyncio.run(
            _run(smollm2_path, engine, tokenizer, setting, device, concurrent, ahead)
        )
        for setting, device, concurrent, ahead in [
            (None, "cpu", True, None),
            (None, "cuda:0", True, None),
            (None, "cuda:0", False, None),  # an in-process engine: nothing would overlap
            (False, "cuda:0", True, None),
            (True, "cpu", True, None),
            (True, "cpu", True, 3),
            (None, "cuda:0", True, 1),
        ]
    }
    expected = runs[(None, "cpu", True, None)][0]
    assert all(len(t) == PARAMS.max_tokens for t in expected)
    behind = {key[:3]: n for key, (_, n, _) in runs.items() if key[3] is None}
    most = {key: m for key, (_, _, m) in runs.items()}
    assert all(tokens == expected for tokens, _, _ in runs.values()), "greedy tokens changed"
    assert behind[(None, "cuda:0", True)] >= PARAMS.max_tokens // 2, behind
    assert behind[(True, "cpu", True)] >= PARAMS.max_tokens // 2, behind
    assert behind[(None, "cpu", True)] == behind[(None, "cuda:0", False)] == 0, behind
    assert behind[(False, "cuda:0", True)] == 0, behind
    # Steps sent and unanswered at once: 1 + steps ahead (2 on a GPU unless set).
    assert most[(None, "cuda:0", True, None)] == 3, most
    assert most[(True, "cpu", True, None)] == most[(None, "cuda:0", True, 1)] == 2, most
    assert most[(True, "cpu", True, 3)] == 4, most
    assert most[(None, "cpu", True, None)] == most[(False, "cuda:0", True, None)] == 1, most


def test_plans_ahead() -> None:
    assert plans_ahead(None, "cuda:1", True) and not plans_ahead(None, "cuda", False)
    assert not plans_ahead(None, "cpu", True) and plans_ahead(True, "cpu", False)
    assert not plans_ahead(False, "cuda:0", True)


def test_steps_ahead() -> None:
    assert steps_ahead(None, "cuda:0") == 2 and steps_ahead(None, "cpu") == 1
    assert steps_ahead(1, "cuda") == 1 and steps_ahead(3, "cpu") == 3
    for bad in (0, 5):
        with pytest.raises(ValueError, match="steps_ahead must be 1 to 4"):
            ControlConfig(model="m", steps_ahead=bad)
