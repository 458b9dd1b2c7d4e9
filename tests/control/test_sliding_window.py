"""The control engine over a real compute engine whose every layer has a sliding window
(tiny Mistral, window 6): it learns the window from Describe, gives back blocks that left
it, and so runs two requests that together need ~2x the pool without preempting either,
each greedy continuation equal to transformers'."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.kv_cache import bytes_per_block
from compute_plane.loader import load_model
from control_plane.compute_client import InProcessLink
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.tokenizer import load_tokenizer
from hetero_proto import control_pb2 as pb
from tests.conftest import hf_greedy, make_tiny_model
from tests.control.streams import stream_tokens

BS = 4
PROMPTS = {"a": [5, 17, 99, 3, 42, 8, 250, 31, 64, 12], "b": [7, 7, 200, 9, 13, 180, 4, 77, 6, 90]}
PARAMS = pb.GenerationParams(max_tokens=30, temperature=0.0, ignore_eos=True)


async def _run(path: Path, tokenizer_path: Path) -> tuple[dict[str, list[int]], int, int]:
    loaded = load_model(path, progress=False)
    budget = 12 * bytes_per_block(loaded.config, BS, torch.float32)
    engine = Engine(
        ComputeConfig(model=str(path), block_size=BS, kv_cache_bytes=budget, metrics_port=-1),
        loaded,
    )
    link = InProcessLink(engine.describe, engine.step, on_attach=engine.reset)
    control = ControlEngine(
        ControlConfig(model=str(path), metrics_port=-1), load_tokenizer(tokenizer_path), link
    )
    await control.start()
    try:
        await control.attached.wait()
        streams = {rid: control.submit(p, PARAMS, request_id=rid) for rid, p in PROMPTS.items()}
        got = await asyncio.gather(*map(stream_tokens, streams.values()))
        return (
            dict(zip(streams, got, strict=True)),
            control.scheduler.num_preemptions,
            (engine.num_blocks),
        )
    finally:
        await control.stop()


@pytest.mark.timeout(300)
def test_two_requests_twice_the_pool_run_without_preemption(
    tmp_path: Path, smollm2_path: Path
) -> None:
    ref = make_tiny_model("mistral", tmp_path, sliding_window=6, vocab_size=256)
    # Any tokenizer serves: the requests are token ids; it only detokenizes.
    got, preemptions, num_blocks = asyncio.run(_run(tmp_path, smollm2_path))
    need = sum(-(-(len(p) + 30) // BS) for p in PROMPTS.values())
    assert need > num_blocks - 1  # 20 blocks of 11: without giving any back, one waits
    assert preemptions == 0
    for rid, prompt in PROMPTS.items():
        assert got[rid] == hf_greedy(ref, prompt, 30), rid
