"""Speculative decoding in the compute engine: proposals verified in one step give the tokens
of one-token decoding (greedy and seeded), accept exactly the prefix the target reproduces,
and a draft model (the target itself, or another with its vocabulary) drafts from its own KV."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from compute_plane.requests import StepRejected
from hetero_proto import compute_pb2 as pb
from tests.compute.step_driver import GREEDY, StepDriver
from tests.conftest import make_tiny_model

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [9, 8, 7, 6, 5, 4, 3, 200, 100, 50, 25]]
STEPS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", out)
    return out


@pytest.fixture(scope="module")
def engine(tiny: Path) -> Engine:
    return Engine(
        ComputeConfig(model=str(tiny), block_size=4, kv_cache_bytes=8 << 20),
        load_model(tiny, progress=False),
    )


def _generate(
    engine: Engine,
    sampling: pb.SamplingParams,
    propose=None,  # type: ignore[no-untyped-def]  # (rid, tokens) -> Proposal fields or None
    steps: int = STEPS,
) -> tuple[dict[str, list[int]], dict[str, list[pb.TokenResult]], list[pb.Accepted]]:
    """Decode every prompt together until each has `steps` new tokens."""
    engine.reset()
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=3)
    tokens = {f"r{i}": list(p) for i, p in enumerate(PROMPTS)}
    out: dict[str, list[int]] = {rid: [] for rid in tokens}
    lps: dict[str, list[pb.TokenResult]] = {rid: [] for rid in tokens}
    accepted: list[pb.Accepted] = []
    res = engine.step(
        drv.step(new=[drv.new(rid, t, len(t), sampling=sampling) for rid, t in tokens.items()])
    )
    while True:
        assert not res.failed and not res.HasField("error"), (res.failed, res.error)
        got = {a.request_id: list(a.token_ids) for a in res.accepted}
        accepted.extend(res.accepted)
        for rid, token in zip(res.sampled_ids, res.sampled_token_ids, strict=True):
            new = [*got.get(rid, []), token]
            out[rid] += new
            tokens[rid] += new
        for r in res.results:
            lps[r.request_id].append(r)
        live = [rid for rid in tokens if len(out[rid]) < steps]
        if not live:
            return {rid: o[:steps] for rid, o in out.items()}, lps, accepted
        cont, proposals = [], []
        for rid in live:
            fields = propose(rid, tokens[rid]) if propose else None
            k = (
                len(fields.get("token_ids", ())) or fields.get("num_draft_tokens", 0)
                if fields
                else 0
            )
            # Blocks for the last known token and the proposals' positions.
            new_ids = drv._grow(rid, len(tokens[rid]) + k)
            cont.append(
                pb.ContinuingRequest(request_id=rid, new_block_ids=new_ids, num_scheduled_tokens=1)
            )
            if fields:
                proposals.append(pb.Proposal(request_id=rid, **fields))
        step = drv.step(cont=cont)
        step.proposals.extend(proposals)
        res = engine.step(step)


def test_greedy_verification_equals_plain_decoding_and_accepts_the_matching_prefix(
    engine: Engine,
) -> None:
    plain, _, _ = _generate(engine, GREEDY)
    rng = random.Random(0)
    k_of: dict[str, int] = {}

    def propose(rid: str, tokens: list[int]) -> dict[str, list[int]]:
        # The right continuation with one wrong token at a random place (or none).
        n = len(tokens) - len(PROMPTS[int(rid[1:])])
        right = plain[rid][n : n + 5]
        k = k_of[rid] = max(1, len(right))
        guess = list(right) or [0]
        wrong = rng.randrange(k + 1)
        if wrong < len(guess):
            guess[wrong] = (guess[wrong] + 1) % 256
        return {"token_ids": guess[:k]}

    spec, _, accepted = _generate(engine, GREEDY, propose)
    assert spec == plain
    assert accepted, "no proposal was verified"
    assert any(a.token_ids for a in accepted), "no proposal was accepted"
    for a in accepted:
        assert len(a.token_ids) <= a.num_proposed
    stats = engine.stats()
    assert stats.num_proposed_tokens == sum(a.num_proposed for a in accepted)
    assert stats.num_accepted_tokens == sum(len(a.token_ids) for a in accepted)


def test_a_wrong_first_proposal_accepts_nothing_and_a_right_one_everything(
    engine: Engine,
) -> None:
    plain, _, _ = _generate(engine, GREEDY)

    def exact(rid: str, tokens: list[int]) -> dict[str, list[int]]:
        n = len(tokens) - len(PROMPTS[int(rid[1:])])
        return {"token_ids": plain[rid][n : n + 3] or [0]}

    def wrong(rid: str, tokens: list[int]) -> dict[str, list[int]]:
        n = len(tokens) - len(PROMPTS[int(rid[1:])])
        return {"token_ids": [(t + 1) % 256 for t in plain[rid][n : n + 3]] or [0]}

    out, _, acc = _generate(engine, GREEDY, exact)
    assert out == plain
    full = [a for a in acc if a.num_proposed == 3]
    assert full and all(len(a.token_ids) == 3 for a in full)
    out, _, acc = _generate(engine, GREEDY, wrong)
    assert out == plain
    assert all(len(a.token_ids) == 0 for a in acc)


def test_seeded_sampling_with_penalties_and_logprobs_is_unchanged_by_proposals(
    engine: Engine,
) -> None:
    params = pb.SamplingParams(
        temperature=0.9,
        top_p=0.95,
        seed=11,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        logprobs=True,
        top_logprobs=2,
    )
    plain, plain_lps, _ = _generate(engine, params)

    def propose(rid: str, tokens: list[int]) -> dict[str, list[int]]:
        n = len(tokens) - len(PROMPTS[int(rid[1:])])
        return {"token_ids": plain[rid][n : n + 4] or [0]}

    spec, spec_lps, acc = _generate(engine, params, propose)
    assert spec == plain
    assert sum(len(a.token_ids) for a in acc) > 0
    for rid in plain:
        got = [(r.token_id, round(r.logprob, 4)) for r in spec_lps[rid][:STEPS]]
        want = [(r.token_id, round(r.logprob, 4)) for r in plain_lps[rid][:STEPS]]
        assert got == want
        assert all(len(r.top_logprobs) == 2 for r in spec_lps[rid])


def test_bad_proposals_fail_their_request_alone(engine: Engine) -> None:
    engine.reset()
    drv = StepDriver(engine.num_blocks, engine.block_size)
    engine.step(drv.step(new=[drv.new(r, [5, 6, 7], 3) for r in ("a", "b", "c")]))
    step = drv.step(cont=[drv.cont(r, 1) for r in ("a", "b", "c")])
    step.proposals.add(request_id="a", token_ids=[999])  # out of the vocabulary
    step.proposals.add(request_id="b", num_draft_tokens=2)  # no draft model here
    res = engine.step(step)
    failed = {f.request_id: f.message for f in res.failed}
    assert set(failed) == {"a", "b"}
    assert "out of range" in failed["a"] and "no draft model" in failed["b"]
    assert list(res.sampled_ids) == ["c"]
    step = drv.step(cont=[drv.cont("c", 1)])
    step.proposals.add(request_id="zzz", token_ids=[1])
    with pytest.raises(StepRejected, match="proposal for a request not in this step"):
        engine.step(step)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_proposals_keep_greedy_output(
    engine: Engine, tiny: Path, tmp_path: Path, draft: str
) -> None:
    plain, _, _ = _generate(engine, GREEDY)
    path = tiny
    if draft == "other":  # same vocabulary, different weights and depth
        path = tmp_path / "draft"
        make_tiny_model("llama", path, seed=7, num_hidden_layers=1)
    drafting = Engine(
        ComputeConfig(model=str(tiny), block_size=4, kv_cache_bytes=8 << 20, draft_model=str(path)),
        load_model(tiny, progress=False),
    )
    assert drafting.describe().draft_model
    for k in (1, 3, 5):
        out, _, acc = _generate(drafting, GREEDY, lambda rid, t, k=k: {"num_draft_tokens": k})
        assert out == plain, k
        rate = sum(len(a.token_ids) for a in acc) / sum(a.num_proposed for a in acc)
        if draft == "self":
            assert rate == 1.0, (k, rate)  # the target drafting for itself is always right
        else:
            assert rate < 1.0


def test_sampled_output_distribution_with_proposals_matches_the_model(
    tmp_path: Path,
) -> None:
    """20k unseeded samples of the first 3 tokens (vocabulary 16, 4,096 sequences), with and
    without proposals, each fit the distribution HF transformers gives (chi-square); a
    distribution at temperature 0.9 does not fit (the test can fail)."""
    import numpy as np
    import torch
    from scipy.stats import chisquare

    hf = make_tiny_model("llama", tmp_path, seed=5, vocab_size=16)
    with torch.no_grad():  # peakier next-token distributions: proposals are often right
        hf.lm_head.weight.mul_(6.0)
    hf.save_pretrained(tmp_path)
    prompt = [3, 9, 4]
    n, vocab = 20_000, 16
    with torch.no_grad():  # exact p(t1) p(t2 | t1) p(t3 | t1, t2) from transformers
        pairs = torch.tensor([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
        logits = hf(pairs).logits.double()

    def exact(temperature: float) -> np.ndarray:
        lp = torch.log_softmax(logits / temperature, -1)
        p1 = lp[0, 2].exp()  # [V]
        p2 = lp[::vocab, 3].exp()  # [V(t1), V]
        p3 = lp[:, 4].exp().reshape(vocab, vocab, vocab)  # [t1, t2, V]
        return (p1[:, None, None] * p2[:, :, None] * p3).flatten().numpy()

    p = exact(1.0)
    most = p.reshape(vocab, vocab, vocab)
    engine = Engine(
        ComputeConfig(model=str(tmp_path), block_size=4, kv_cache_bytes=256 << 20),
        load_model(tmp_path, progress=False),
    )
    params = pb.SamplingParams(temperature=1.0)

    def sample(speculate: bool) -> np.ndarray:
        engine.reset()
        drv = StepDriver(engine.num_blocks, engine.block_size)
        ids = [f"s{i}" for i in range(n)]
        out: dict[str, list[int]] = {}
        res = engine.step(drv.step(new=[drv.new(r, prompt, 3, sampling=params) for r in ids]))
        out = {r: [t] for r, t in zip(res.sampled_ids, res.sampled_token_ids, strict=True)}
        while live := [r for r in ids if len(out[r]) < 3]:
            step_cont, proposals = [], []
            for r in live:
                k = 3 - len(out[r]) if speculate else 0
                # The most likely continuation under the model: accepted often, not always.
                guess: list[int] = []
                t = out[r]
                if k >= 1:
                    g2 = int(most[t[0]].sum(axis=1).argmax()) if len(t) == 1 else None
                    guess = [g2] if g2 is not None else [int(most[t[0], t[1]].argmax())]
                    if k == 2:
                        guess.append(int(most[t[0], guess[0]].argmax()))
                new_ids = drv._grow(r, len(prompt) + len(t) + len(guess))
                step_cont.append(
                    pb.ContinuingRequest(
                        request_id=r, new_block_ids=new_ids, num_scheduled_tokens=1
                    )
                )
                if guess:
                    proposals.append(pb.Proposal(request_id=r, token_ids=guess))
            step = drv.step(cont=step_cont)
            step.proposals.extend(proposals)
            res = engine.step(step)
            acc = {a.request_id: list(a.token_ids) for a in res.accepted}
            for r, tok in zip(res.sampled_ids, res.sampled_token_ids, strict=True):
                out[r] += [*acc.get(r, []), tok]
        seqs = np.array([o[:3] for o in out.values()])
        return np.bincount(
            seqs[:, 0] * vocab * vocab + seqs[:, 1] * vocab + seqs[:, 2], minlength=vocab**3
        )

    def fit(counts: np.ndarray, probs: np.ndarray) -> float:
        expected = probs * counts.sum()
        big = expected >= 5  # cells expected fewer than 5 times go into one
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)

    torch.manual_seed(0)
    plain, spec = sample(False), sample(True)
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0.1 * stats.num_proposed_tokens
    assert stats.num_accepted_tokens < stats.num_proposed_tokens
    assert fit(plain, p) > 1e-3
    assert fit(spec, p) > 1e-3
    assert fit(spec, exact(0.9)) < 1e-6


def test_a_step_verifying_proposals_is_timed_as_a_decode(engine: Engine) -> None:
    """hetero_compute_step_duration_seconds{kind}: decodes with proposals are decodes (the
    rows compute k + 1 tokens each; they were timed as prefill steps)."""
    from prometheus_client import REGISTRY

    def steps(kind: str) -> float:
        labels = {"kind": kind, **engine.metric_labels}
        return REGISTRY.get_sample_value("hetero_compute_step_duration_seconds_count", labels) or 0

    plain, _, _ = _generate(engine, GREEDY)
    before = {kind: steps(kind) for kind in ("prefill", "decode", "mixed")}

    def exact(rid: str, tokens: list[int]) -> dict[str, list[int]]:
        n = len(tokens) - len(PROMPTS[int(rid[1:])])
        return {"token_ids": plain[rid][n : n + 3] or [0]}

    _generate(engine, GREEDY, exact)
    assert steps("prefill") == before["prefill"] + 1  # the prompts' step alone
    assert steps("mixed") == before["mixed"]
    assert steps("decode") > before["decode"]
