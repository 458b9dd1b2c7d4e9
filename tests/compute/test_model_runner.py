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
from compute_plane.model_runner import BlockTables, ModelRunner
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


def _runner(engine: Engine, tokens: int, seqs: int, staged: bool = False) -> ModelRunner:
    return ModelRunner(
        engine.model, engine.kv_cache, None, tokens, seqs, engine.max_model_len, CPU, staged
    )


@pytest.mark.parametrize("staged", [False, True], ids=["host-views", "staged"])
def test_prefill_logits_match_transformers_and_small_buffers_grow(tiny, staged: bool) -> None:  # type: ignore[no-untyped-def]
    engine, ref = tiny
    runner = _runner(engine, tokens=8, seqs=1, staged=staged)  # smaller than the step below
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


@pytest.mark.parametrize("staged", [False, True], ids=["host-views", "staged"])
def test_decode_steps_reuse_the_buffers_and_stay_exact(tiny, staged: bool) -> None:  # type: ignore[no-untyped-def]
    engine, ref = tiny
    runner = _runner(engine, tokens=64, seqs=4, staged=staged)
    reqs = Requests(engine, seed=1)
    rows = [reqs.new("x", 9), reqs.new("y", 17)]
    buffers = (
        runner._tokens.data_ptr(),
        runner._ints.data_ptr(),
        runner._tokens_dev.data_ptr(),
        runner._ints_dev.data_ptr(),
        runner.capacity,
    )
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
    assert (
        runner._tokens.data_ptr(),
        runner._ints.data_ptr(),
        runner._tokens_dev.data_ptr(),
        runner._ints_dev.data_ptr(),
        runner.capacity,
    ) == buffers


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


def _within(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    return start <= view.data_ptr() < start + size


def test_a_staged_step_is_views_of_the_device_buffers(tiny) -> None:  # type: ignore[no-untyped-def]
    """The GPU's input path, checked on the CPU: every tensor a step passes on lies in the
    device buffers (nothing allocated per step), holds what the rows say, and the
    attention lengths and prefill query starts are there too."""
    engine, _ = tiny
    runner = _runner(engine, tokens=64, seqs=4, staged=True)
    reqs = Requests(engine, seed=3)
    a, b = reqs.new("a", 5), reqs.new("b", 6)
    runner.run([a, b])
    decode = reqs.decode("a", 7)
    chunk = Row("c", reqs.new("c", 9).state, 0, 4)  # a chunk: first 4 of 9, samples nothing
    x = runner.prepare([decode, Row("b", b.state, 2, 4), chunk])
    tok, ints = runner._tokens_dev, runner._ints_dev
    assert tok.data_ptr() != runner._tokens.data_ptr()  # a mirror, not the host buffer
    m = x.meta
    for t in (x.input_ids, x.positions, x.sample_index, m.slot_mapping):
        assert _within(t, tok)
    for t in (m.block_tables, m.seq_lens_tensor, m.query_start_loc):
        assert t is not None and _within(t, ints)
    assert x.input_ids.tolist() == [7, *b.state.token_ids[2:6], *chunk.state.token_ids[:4]]
    assert x.positions.tolist() == [5, 2, 3, 4, 5, 0, 1, 2, 3]
    assert x.sample_index.tolist() == [0, 4]  # a's token, b's last; the chunk samples nothing
    assert m.seq_lens_tensor.tolist() == [6, 6, 4] and m.num_decodes == 1
    assert m.query_start_loc.tolist() == [0, 4, 8]  # the prefill chunks' rows, from 0
    widths = [len(s.block_ids) for s in (a.state, b.state, chunk.state)]
    assert m.block_tables.shape == (3, max(widths))
    for row, st in zip(m.block_tables.tolist(), (a.state, b.state, chunk.state), strict=True):
        assert row == st.block_ids + [0] * (max(widths) - len(st.block_ids))


def test_block_tables_follow_growth_resends_and_releases(tiny) -> None:  # type: ignore[no-untyped-def]
    """The runner keeps each request's table between steps and writes only what changed:
    every step's tables must still equal the requests' block lists, 0-padded, as blocks
    are added, a request is re-sent under its id with other blocks, and rows of released
    requests are reused."""
    engine, _ = tiny
    runner = _runner(engine, tokens=64, seqs=4)
    reqs = Requests(engine, seed=4)

    def tables_of(rows: list[Row]) -> list[list[int]]:
        x = runner.prepare(rows)
        width = max(len(r.state.block_ids) for r in rows)
        assert x.meta.block_tables.shape == (len(rows), width)
        return x.meta.block_tables.tolist()

    def expected(rows: list[Row]) -> list[list[int]]:
        width = max(len(r.state.block_ids) for r in rows)
        return [r.state.block_ids + [0] * (width - len(r.state.block_ids)) for r in rows]

    a, b = reqs.new("a", 5), reqs.new("b", 9)
    assert tables_of([a, b]) == expected([a, b])
    b.state.block_ids.append(reqs.free.pop())  # a block added between steps
    a2 = reqs.decode("a", 3)
    rows = [a2, reqs.decode("b", 4)]
    assert tables_of(rows) == expected(rows)
    again = reqs.new("a", 3)  # re-sent under its id: a new state, fewer blocks
    assert tables_of([again]) == expected([again])
    b_row = runner.tables.held["b"][0]
    runner.release("b")
    c = reqs.new("c", 2)  # takes b's freed row: nothing of b's table may show
    long = reqs.new("d", 20)  # wider than b was: c's row is read past its own blocks
    assert len(c.state.block_ids) < len(b.state.block_ids) < len(long.state.block_ids)
    assert tables_of([c, long]) == expected([c, long])
    assert runner.tables.held["c"][0] == b_row
    runner.release_all()
    assert not runner.tables.held and not runner.tables.rows.any()


def test_block_tables_grow_past_their_columns() -> None:
    """A table longer than the columns made for max_model_len widens the store (the
    runner's buffers grow for such a step) instead of failing."""
    tables = BlockTables(cols=2)
    st = RequestState([1, 2, 3], 3, 0, [7, 8, 9, 10, 11], SamplingSpec())
    row = tables.row("a", st)
    assert tables.rows.shape[1] >= 5 and tables.rows[row, :5].tolist() == [7, 8, 9, 10, 11]


class _PiecesSpy:
    """Stands in for PiecewiseGraphs (CUDA only) in a test of the runner's routing: it
    records the sizes it is asked to replay and runs the forward eagerly."""

    def __init__(self, engine: Engine, sizes: list[int]) -> None:
        self.engine, self.sizes, self.replayed = engine, sizes, []  # type: ignore[var-annotated]

    def padded_size(self, n: int) -> int | None:
        return next((t for t in self.sizes if t >= n), None)

    def run(self, t, input_ids, positions, meta):  # type: ignore[no-untyped-def]
        self.replayed.append((t, int(input_ids.shape[0]), meta.num_decodes, len(meta.seq_lens)))
        return self.engine.model.forward(input_ids, positions, meta, self.engine.kv_cache.layers)


def test_steps_go_to_the_piecewise_graphs_by_token_count(tiny) -> None:  # type: ignore[no-untyped-def]
    """With no decode graphs, a step of n tokens replays the smallest piecewise size >= n
    (a mixed step: its decodes and chunks), and one larger than every size runs eagerly;
    the logits are transformers' either way."""
    engine, ref = tiny
    spy = _PiecesSpy(engine, [8, 16])
    runner = ModelRunner(
        engine.model, engine.kv_cache, None, 32, 4, engine.max_model_len, CPU,
        pieces=spy,  # type: ignore[arg-type]
    )  # fmt: skip
    reqs = Requests(engine, seed=3)
    a, b = reqs.new("a", 20), reqs.new("b", 6)
    runner.run([a], capture_logits=True)  # 20 tokens: eager
    out = runner.run([reqs.decode("a", 5), b], capture_logits=True)  # 1 + 6: size 8
    c = reqs.new("c", 9)
    last = runner.run([reqs.decode("a", 7), reqs.decode("b", 8), c], capture_logits=True)
    assert spy.replayed == [(8, 7, 1, 2), (16, 11, 2, 3)]
    assert runner.forwards == {"decode_graph": 0, "piecewise": 2, "eager": 1}
    assert last.logits_by_row is not None and out.logits_by_row is not None
    for rid, ours in (("a", last.logits_by_row[0]), ("c", last.logits_by_row[2])):
        expected = _reference(ref, reqs.states[rid].token_ids)[-ours.shape[0] :]
        err = (ours - expected).abs().max().item()
        assert err <= TOL, f"{rid}: max abs logit difference {err:.2e}"


def test_piecewise_graph_sizes_and_their_flag() -> None:
    from compute_plane.cuda_graphs import graph_batch_sizes, graph_token_sizes

    assert graph_token_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert graph_token_sizes(300) == [16, 32, 64, 128, 256, 300]
    assert graph_token_sizes(16) == [16] and graph_token_sizes(10) == [10]
    assert graph_token_sizes(0) == []
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="piecewise_graphs must be >= 0"):
        ComputeConfig(model="m", piecewise_graphs=-1)
