"""The model runner alone (prepare inputs -> forward -> sample), no engine step, no gRPC:
its logits equal transformers' on the same tokens (fp32, <= 1e-3), over blocks scattered
through the cache; its input buffers are reused step after step, and grow once for a
step larger than they were made for."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from compute_plane.model_runner import ModelRunner
from compute_plane.requests import RequestState, Row
from hetero_common.sampling_params import SamplingSpec
from tests.conftest import make_tiny_model

TOL = 1e-3
BS = 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(an engine's model and cache, the HF reference model)."""
    out: Path = tmp_path_factory.mktemp("tiny-llama")
    ref = make_tiny_model("llama", out)
    cfg = ComputeConfig(model=str(out), block_size=BS, kv_cache_bytes=16 << 20)
    return Engine(cfg, load_model(out, progress=False)), ref


class Requests:
    """Requests with blocks drawn from a shuffled pool, as a long-running server has them."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.free = list(range(1, engine.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.states: dict[str, RequestState] = {}

    def new(self, rid: str, n: int) -> Row:
        tokens = [self.rng.randrange(3, self.vocab) for _ in range(n)]
        blocks = [self.free.pop() for _ in range(-(-n // BS) + 4)]  # room to decode
        st = self.states[rid] = RequestState(tokens, n, 0, blocks, SamplingSpec())
        return Row(rid, st, 0, n)

    def decode(self, rid: str, token: int) -> Row:
        st = self.states[rid]
        st.num_computed_tokens = len(st.token_ids)
        st.token_ids.append(token)
        return Row(rid, st, st.num_computed_tokens, 1)


def _reference(ref, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def _runner(engine: Engine, tokens: int, seqs: int) -> ModelRunner:
    return ModelRunner(engine.model, engine.kv_cache, None, tokens, seqs, engine.max_model_len, CPU)


def test_prefill_logits_match_transformers_and_small_buffers_grow(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, ref = tiny
    runner = _runner(engine, tokens=8, seqs=1)  # smaller than the step below
    reqs = Requests(engine)
    rows = [reqs.new("a", 13), reqs.new("b", 7)]
    out = runner.run(rows, capture_logits=True)
    assert out.num_tokens == 20 and runner.capacity[0] >= 20 and runner.capacity[1] >= 2
    assert out.logits_by_row is not None and out.sampled is not None
    for row, ours in zip(rows, out.logits_by_row, strict=True):
        expected = _reference(ref, row.state.token_ids)
        assert (ours - expected).abs().max().item() <= TOL
    # Greedy: the sampled token is the reference's argmax at the last position.
    greedy = [int(_reference(ref, r.state.token_ids)[-1].argmax()) for r in rows]
    assert out.sampled.token_ids == greedy


def test_decode_steps_reuse_the_buffers_and_stay_exact(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, ref = tiny
    runner = _runner(engine, tokens=64, seqs=4)
    reqs = Requests(engine, seed=1)
    rows = [reqs.new("x", 9), reqs.new("y", 17)]
    buffers = (runner._tokens.data_ptr(), runner._tables.data_ptr(), runner.capacity)
    out = runner.run(rows)
    for _ in range(3):
        assert out.sampled is not None
        rows = [
            reqs.decode(r.request_id, t) for r, t in zip(rows, out.sampled.token_ids, strict=True)
        ]
        out = runner.run(rows, capture_logits=True)
        assert out.logits_by_row is not None and out.num_tokens == 2
        for row, ours in zip(rows, out.logits_by_row, strict=True):
            expected = _reference(ref, row.state.token_ids)[-1:]
            assert (ours - expected).abs().max().item() <= TOL
    assert (runner._tokens.data_ptr(), runner._tables.data_ptr(), runner.capacity) == buffers


def test_prepare_builds_slots_from_the_block_tables(tiny) -> None:  # type: ignore[no-untyped-def]
    engine, _ = tiny
    runner = _runner(engine, tokens=16, seqs=2)
    reqs = Requests(engine, seed=2)
    row = reqs.new("p", 6)
    x = runner.prepare([row])
    blocks = row.state.block_ids
    expected = [blocks[p // BS] * BS + p % BS for p in range(6)]  # slot = block * size + offset
    assert x.meta.slot_mapping.tolist() == expected
    assert x.positions.tolist() == list(range(6)) and x.input_ids.tolist() == row.state.token_ids
    assert x.meta.block_tables[0].tolist() == blocks and [r.request_id for r in x.sample_rows] == [
        "p"
    ]
