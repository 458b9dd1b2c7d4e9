"""How the piecewise CUDA graphs cut a forward, on the CPU: torch's CUDA graph and stream
API replaced by recorders (the GPU runs the real graphs: test_engine_triton.py's
cuda-graphs cases). The capture's forward must call attention once per layer through
`Model.attend` with that layer's cache and window, end one piece at each call and give
the model back its attend; a replay runs piece i, then layer i's attention on the step's
rows into the buffer piece i + 1 reads, and the last piece after the last attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from compute_plane.attention import AttentionMetadata
from compute_plane.config import ComputeConfig
from compute_plane.cuda_graphs import PiecewiseGraphs
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from tests.conftest import make_tiny_model

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the recorders stand in for CUDA, which is here"
)

BLOCK = 8


class _Recorder:
    """The CUDA graph and stream calls PiecewiseGraphs makes, written to one log."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log
        outer = self

        class Graph:
            def capture_begin(self, pool: Any = None) -> None:
                self.id = sum(1 for e in outer.log if e[0] == "begin")
                outer.log.append(("begin", self.id, pool))

            def capture_end(self) -> None:
                outer.log.append(("end", self.id))

            def pool(self) -> str:
                return "pool"

            def replay(self) -> None:
                outer.log.append(("replay", self.id))

        class Stream:
            def __init__(self, *args: Any) -> None:
                pass

            def wait_stream(self, other: Any) -> None:
                pass

        class StreamContext:
            def __init__(self, stream: Any) -> None:
                pass

            def __enter__(self) -> None:
                outer.log.append(("side stream",))

            def __exit__(self, *exc: Any) -> None:
                outer.log.append(("main stream",))

        self.graph, self.stream, self.context = Graph, Stream, StreamContext


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def engine(request, tmp_path_factory) -> Engine:  # type: ignore[no-untyped-def]
    out: Path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, out)
    cfg = ComputeConfig(
        model=str(out), device="cpu", dtype="float32", attention_backend="triton",
        block_size=BLOCK, kv_cache_bytes=4 << 20,
    )  # fmt: skip
    return Engine(cfg, load_model(out, progress=False))


def test_a_capture_cuts_at_each_attention_and_a_replay_runs_them_in_turn(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[Any] = []
    rec = _Recorder(log)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", rec.graph)
    monkeypatch.setattr(torch.cuda, "Stream", rec.stream)
    monkeypatch.setattr(torch.cuda, "stream", rec.context)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: rec.stream())
    model = engine.model
    layers = len(model.layers)
    attend = model.attend
    pieces = PiecewiseGraphs(model, engine.kv_cache.layers, 32, BLOCK)
    assert pieces.sizes == [16, 32]
    pieces.capture()
    assert model.attend is attend, "the model's attention is given back after the capture"
    # Largest size first; each: L + 1 pieces, begun and ended in turn on a side stream,
    # all in the first piece's pool.
    expected: list[Any] = []
    for i in range(2 * (layers + 1)):
        if i % (layers + 1) == 0:
            expected.append(("side stream",))
        expected += [("begin", i, None if i == 0 else "pool"), ("end", i)]
        if i % (layers + 1) == layers:
            expected.append(("main stream",))
    assert log == expected
    # where each size's capture time went, for start-up's figures (benchmarks.gpu)
    assert list(pieces.capture_by_size) == [32, 16]
    for times in pieces.capture_by_size.values():
        assert set(times) == {"warm_s", "capture_s", "graph_api_s"}
        assert 0 <= times["graph_api_s"] <= times["capture_s"]
    for t in (16, 32):
        calls = pieces.calls[t]
        assert len(pieces.pieces[t]) == layers + 1 and len(calls) == layers
        for (q, k_cache, v_cache, window), layer, (k, v) in zip(
            calls, model.layers, engine.kv_cache.layers, strict=True
        ):
            assert q.shape == (t, model.cfg.num_attention_heads, model.cfg.head_dim)
            assert k_cache is k and v_cache is v and window == layer.window
        assert pieces.outputs[t].shape == (t, model.cfg.hidden_size)
    if model.cfg.sliding_window is not None:  # Gemma 3: local and global layers both
        assert len({c[3] for c in pieces.calls[16]}) == 2

    # A step of 3 decodes and a chunk of 9 tokens (12 rows) replays size 16.
    log.clear()
    attended: list[tuple[int, int, int, int | None, int]] = []

    def attend_into(q, k_cache, v_cache, meta, window, out):  # type: ignore[no-untyped-def]
        layer = next(i for i, (k, _) in enumerate(engine.kv_cache.layers) if k is k_cache)
        assert out.data_ptr() == pieces.attn_out.data_ptr()
        attended.append((len(log), layer, q.shape[0], window, out.shape[0]))
        log.append(("attend", layer))
        return out

    pieces._attend_into = attend_into
    n = 12
    lens = [5, 9, 17, 9]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.zeros((4, 3), dtype=torch.int32),
        seq_lens=lens,
        query_lens=[1, 1, 1, 9],
        num_decodes=3,
        block_size=BLOCK,
        seq_lens_tensor=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 9], dtype=torch.int32),
    )
    ids = torch.arange(1, n + 1)
    hidden = pieces.run(pieces.padded_size(n) or 0, ids, torch.arange(n), meta)
    first = 2 * (layers + 1) - (layers + 1)  # size 16 was captured second
    expected = []
    for i in range(layers):
        expected += [("replay", first + i), ("attend", i)]
    assert log == [*expected, ("replay", first + layers)]
    assert [a[2:] for a in attended] == [(n, layer.window, n) for layer in model.layers]
    assert hidden.shape == (n, model.cfg.hidden_size)
    assert torch.equal(pieces.input_ids[:16], torch.cat([ids, torch.zeros(4, dtype=torch.long)]))
    assert torch.equal(pieces.slots[n:16], torch.zeros(4, dtype=torch.long))
    assert pieces.padded_size(33) is None and pieces.padded_size(17) == 32
