"""A control plane asked for speculative decoding attaches no compute plane that cannot do
it: the first one refused is a start-up error, a later one (a compute plane restarted
without its draft model) is left unattached and its requests wait for a compute plane that
can. It was attached and served without speculation, with one ERROR line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from control_plane.compute_client import ComputeLinkError, InProcessLink
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.tokenizer import load_tokenizer
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb
from tests.control.streams import stream_tokens

NO_DRAFT = "--speculative draft: the compute plane at in-process holds no draft model"


@pytest.fixture(scope="module")
def engine(smollm2_path: Path) -> Engine:
    config = ComputeConfig(model=str(smollm2_path), kv_cache_bytes=16 << 20, metrics_port=-1)
    return Engine(config, load_model(smollm2_path, progress=False))


def _control(path: Path, link: InProcessLink, **config: object) -> ControlEngine:
    config = {"speculative": "draft", **config}
    cfg = ControlConfig(model=str(path), metrics_port=-1, **config)  # type: ignore[arg-type]
    return ControlEngine(cfg, load_tokenizer(path), link)


async def _first_attached(control: ControlEngine) -> None:
    await control.start()
    try:
        await asyncio.wait_for(control.first_attached(), 10)
    finally:
        await control.stop()


def test_a_first_compute_plane_without_a_draft_model_is_a_start_up_error(
    engine: Engine, smollm2_path: Path
) -> None:
    control = _control(smollm2_path, InProcessLink(engine.describe, engine.step))
    with pytest.raises(ValueError, match=NO_DRAFT):
        asyncio.run(_first_attached(control))
    assert not control.attached.is_set()


def test_a_compute_plane_that_comes_back_without_its_draft_model_is_not_attached(
    engine: Engine, smollm2_path: Path
) -> None:
    with_draft = cpb.DescribeResponse()
    with_draft.CopyFrom(engine.describe())
    with_draft.draft_model = "draft"
    describes = [with_draft]

    def describe() -> cpb.DescribeResponse:
        return describes.pop() if describes else engine.describe()

    def answer(step: cpb.StepRequest) -> cpb.StepResult:
        raise ComputeLinkError("the compute plane died")  # restarted: without a draft model

    async def run() -> BaseException | list[int]:
        control = _control(smollm2_path, InProcessLink(describe, answer), compute_timeout=1.0)
        await control.start()
        try:
            await control.first_attached()
            params = pb.GenerationParams(max_tokens=4, temperature=0.0)
            result = await stream_tokens(control.submit([504, 3458, 281], params), errors=True)
            assert not control.attached.is_set()  # refused again at each try
            assert not control.unfit_at_start.is_set()  # it served: not a start-up error
            return result
        finally:
            await control.stop()

    result = asyncio.run(run())
    assert isinstance(result, BaseException), result
    # failed after --compute-timeout, as requests waiting for a lost compute plane are
    assert str(result) == f"compute plane lost: {NO_DRAFT} (start it with --draft-model)"


def test_a_k_past_the_compute_planes_is_capped_naming_both_flags(
    engine: Engine, smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The warning named the fields (num_speculative_tokens 8 capped at the compute
    # plane's max_speculative_tokens 2); the operator typed the flags.
    d = cpb.DescribeResponse()
    d.CopyFrom(engine.describe())
    d.max_speculative_tokens = 2
    link = InProcessLink(lambda: d, engine.step)
    control = _control(smollm2_path, link, speculative="ngram", num_speculative_tokens=8)
    with caplog.at_level(logging.WARNING, logger="control_plane"):
        asyncio.run(_first_attached(control))
    capped = "--num-speculative-tokens 8 capped at the compute plane's --max-speculative-tokens 2"
    assert capped in caplog.text
