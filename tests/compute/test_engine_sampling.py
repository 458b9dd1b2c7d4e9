"""Seeded sampling through the engine: reproducible whatever the batch, seeds differ, top-k 1 = greedy."""

from __future__ import annotations

from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from compute_plane.requests import StepRejected
from control_plane.compute_client import sampled_tokens
from hetero_proto import compute_pb2 as pb
from tests.compute.step_driver import GREEDY, StepDriver
from tests.conftest import make_tiny_model

PROMPT = [5, 17, 33, 2, 90, 41, 7]
STEPS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:  # type: ignore[no-untyped-def]
    out: Path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", out)
    return Engine(
        ComputeConfig(model=str(out), block_size=4, kv_cache_bytes=8 << 20),
        load_model(out, progress=False),
    )


def _run(
    engine: Engine, requests: dict[str, tuple[list[int], pb.SamplingParams]], seed: int
) -> dict[str, list[int]]:
    """Run all requests together for STEPS sampled tokens each; return their outputs."""
    engine.reset()
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=seed)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    news = [drv.new(rid, p, len(p), sampling=s) for rid, (p, s) in requests.items()]
    res = engine.step(drv.step(new=news))
    for _ in range(STEPS):
        assert not res.results  # logprobs only for requests that ask
        for rid, token in sampled_tokens(res).items():
            out[rid].append(token)
        res = engine.step(drv.step(cont=[drv.cont(rid, 1) for rid in requests]))
    return out


def _seeded(seed: int, **kw: float) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=1.0, seed=seed, **kw)  # type: ignore[arg-type]


def test_seed_reproducible_across_batch_compositions(engine: Engine) -> None:
    alone = _run(engine, {"x": (PROMPT, _seeded(7))}, seed=0)["x"]
    batch = {
        "a": ([9, 9, 9], _seeded(1)),
        "b": (list(range(3, 30)), pb.SamplingParams(temperature=0.8)),  # unseeded
        "x": (PROMPT, _seeded(7)),
        "c": ([4], GREEDY),
    }
    together = _run(engine, batch, seed=1)["x"]
    assert together == alone
    assert _run(engine, {"x": (PROMPT, _seeded(7))}, seed=2)["x"] == alone


def test_different_seeds_differ(engine: Engine) -> None:
    outs = {s: _run(engine, {"x": (PROMPT, _seeded(s))}, seed=0)["x"] for s in (1, 2, 3)}
    assert len({tuple(v) for v in outs.values()}) == 3


def test_top_k_one_equals_greedy(engine: Engine) -> None:
    greedy = _run(engine, {"g": (PROMPT, GREEDY)}, seed=0)["g"]
    top1 = _run(engine, {"g": (PROMPT, pb.SamplingParams(temperature=1.0, top_k=1))}, seed=0)["g"]
    assert top1 == greedy


def test_logprobs_returned_when_asked(engine: Engine) -> None:
    engine.reset()
    drv = StepDriver(engine.num_blocks, engine.block_size)
    params = pb.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    res = engine.step(drv.step(new=[drv.new("lp", PROMPT, len(PROMPT), sampling=params)]))
    (r,) = res.results
    assert sampled_tokens(res) == {"lp": r.token_id}
    assert len(r.top_logprobs) == 3
    assert r.top_logprobs[0].token_id == r.token_id  # greedy picks the most likely token
    assert r.logprob == pytest.approx(r.top_logprobs[0].logprob)
    assert r.top_logprobs[0].logprob >= r.top_logprobs[1].logprob >= r.top_logprobs[2].logprob


def test_min_tokens_masks_banned_ids(engine: Engine) -> None:
    greedy = _run(engine, {"g": (PROMPT, GREEDY)}, seed=0)["g"]
    first = greedy[0]
    # Ban the greedy first token until 3 tokens exist: the first token must change.
    params = pb.SamplingParams(temperature=0.0, min_tokens=3, min_tokens_banned_ids=[first])
    masked = _run(engine, {"m": (PROMPT, params)}, seed=0)["m"]
    assert masked[0] != first
    assert first not in masked[:3]


def _raise_for_bad(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch holding the request "bad" raises, as an out-of-range index would."""
    run = engine.runner.run

    def run_raising(rows, capture_logits=False, defer=False):  # type: ignore[no-untyped-def]
        if any(r.request_id == "bad" for r in rows):
            raise IndexError("index 1000000000 is out of bounds")
        return run(rows, capture_logits, defer)

    monkeypatch.setattr(engine.runner, "run", run_raising)


def test_a_request_that_raises_fails_alone(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """When a batch raises, the engine runs its requests one by one: the one that raises
    alone is failed (INTERNAL), the others get the tokens they get without it."""
    alone = _run(engine, {"good": (PROMPT, GREEDY)}, seed=3)["good"]
    engine.reset()
    _raise_for_bad(engine, monkeypatch)
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=3)
    res = engine.step(drv.step(new=[drv.new(r, PROMPT, len(PROMPT)) for r in ("good", "bad")]))
    (failure,) = res.failed
    assert failure.request_id == "bad" and failure.code == "INTERNAL"
    assert "IndexError" in failure.message
    assert list(res.sampled_ids) == ["good"] and set(engine.requests) == {"good"}
    got = list(res.sampled_token_ids)
    while len(got) < STEPS:
        got += engine.step(drv.step(cont=[drv.cont("good", 1)])).sampled_token_ids
    assert got == alone[:STEPS]
    assert engine.stats().num_failed_requests >= 1
    # Alone in its step, a raising request is the engine's fault as far as it can tell.
    with pytest.raises(IndexError):
        engine.step(drv.step(new=[drv.new("bad", PROMPT, len(PROMPT))]))


def test_a_failed_request_named_by_a_step_planned_ahead_fails_again(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling the control plane sends step k+1 before it learns that step k
    failed a request alone: step k+1 still decodes it. That step runs (the request is
    reported failed again, not counted twice); once a step releases it, naming it again
    is a malformed step."""
    engine.reset()
    _raise_for_bad(engine, monkeypatch)
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=5)
    failed_before = engine.stats().num_failed_requests
    res = engine.step(drv.step(new=[drv.new(r, PROMPT, len(PROMPT)) for r in ("good", "bad")]))
    assert [f.request_id for f in res.failed] == ["bad"]
    # Planned before the failure was known: "bad" decodes (and takes a block) again.
    ahead = drv.step(cont=[drv.cont("good", 1), drv.cont("bad", 1)], pack_decodes=False)
    res = engine.step(ahead)
    assert [(f.request_id, f.code) for f in res.failed] == [("bad", "INTERNAL")]
    assert list(res.sampled_ids) == ["good"]
    assert engine.stats().num_failed_requests == failed_before + 1
    res = engine.step(drv.step(cont=[drv.cont("good", 1)], finished=["bad"]))
    assert not res.failed and list(res.sampled_ids) == ["good"]
    with pytest.raises(StepRejected, match="unknown request id 'bad'"):
        engine.step(drv.step(cont=[drv.cont("good", 1), drv.cont("bad", 1)]))


def test_token_masks_constrain_one_request_and_bad_masks_fail_alone(engine: Engine) -> None:
    from compute_plane.requests import StepRejected

    engine.reset()
    drv = StepDriver(engine.num_blocks, engine.block_size)
    news = [drv.new(rid, PROMPT, len(PROMPT), sampling=GREEDY) for rid in ("free", "m", "bad")]
    step = drv.step(new=news)
    vocab = engine.model_config.vocab_size
    step.masks.add(request_id="m", size=vocab, ids=[11, 12])
    step.masks.add(request_id="bad", size=vocab, ids=[vocab])  # out of range
    res = engine.step(step)
    got = sampled_tokens(res)
    assert got["m"] in (11, 12)
    assert "bad" not in got and [f.request_id for f in res.failed] == ["bad"]
    assert "out of range" in res.failed[0].message
    free_alone = _run(engine, {"free": (PROMPT, GREEDY)}, seed=0)["free"][0]
    assert got["free"] == free_alone  # the unconstrained request is untouched
    # A mask for a request that is not in the step rejects the whole step.
    engine.reset()
    drv = StepDriver(engine.num_blocks, engine.block_size)
    step = drv.step(new=[drv.new("a", PROMPT, len(PROMPT), sampling=GREEDY)])
    step.masks.add(request_id="ghost", size=vocab, ids=[1])
    with pytest.raises(StepRejected, match="not in this step"):
        engine.step(step)
    assert not engine.requests  # nothing changed
    step = drv.step(new=[drv.new("b", PROMPT, len(PROMPT), sampling=GREEDY)])
    step.masks.add(request_id="b", size=vocab, ids=list(range(vocab)), invert=True)
    res = engine.step(step)
    assert "allows no token" in res.failed[0].message


def test_steps_counter_counts_the_steps_the_step_histograms_observe(engine: Engine) -> None:
    """hetero_compute_steps_total counts steps that ran a forward, as the step duration,
    tokens and seqs histograms observe them: a step that only releases requests, or whose
    only request fails alone, runs none (it was counted, so the counter ran ahead of the
    histograms' _count)."""
    from prometheus_client import REGISTRY

    m = engine.metric_labels

    def counts() -> tuple[float, ...]:
        def get(name: str, **labels: str) -> float:
            return REGISTRY.get_sample_value(name, {**labels, **m}) or 0.0

        steps = sum(get("hetero_compute_steps_total", overlapped=o) for o in ("true", "false"))
        timed = sum(
            get("hetero_compute_step_duration_seconds_count", kind=k)
            for k in ("prefill", "decode", "mixed")
        )
        tokens = get("hetero_compute_tokens_per_step_count")
        return steps, timed, tokens, get("hetero_compute_seqs_per_step_count")

    engine.reset()
    drv = StepDriver(engine.num_blocks, engine.block_size)
    before = counts()
    engine.step(drv.step(new=[drv.new("a", PROMPT, len(PROMPT))]))
    engine.step(drv.step(cont=[drv.cont("a", 1)]))
    engine.step(drv.step(finished=["a"]))  # releases only
    bad = drv.step(new=[drv.new("bad", PROMPT, len(PROMPT))])
    bad.masks.add(request_id="bad", size=engine.model_config.vocab_size, ids=[1 << 30])
    assert [f.request_id for f in engine.step(bad).failed] == ["bad"]
    assert [a - b for a, b in zip(counts(), before, strict=True)] == [2, 2, 2, 2]
