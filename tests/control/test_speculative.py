"""Speculative decoding in the control plane: n-gram proposals, per-request adaptivity, and the
scheduler's block accounting following the accepted length (a compute plane simulated here
that accepts what the test says)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.request import Request, Status
from control_plane.scheduler import Scheduler
from control_plane.speculative import SpeculativeConfig, Speculator, ngram_propose

BS = 4
EOS = 0


def _naive_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        follows = [
            tokens[i + n : i + n + k]
            for i in range(len(tokens) - n - 1, -1, -1)  # latest first
            if tokens[i : i + n] == suffix
        ]
        if follows:
            return max(follows, key=len)  # the first of the longest
    return []


def test_ngram_proposes_what_followed_the_latest_earlier_match() -> None:
    toks = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # The longest suffix that recurs is [1, 2, 3]; its latest earlier occurrence is at 7.
    assert ngram_propose(toks, 3, 1, 4) == [7, 8, 1]
    assert ngram_propose(toks, 2, 1, 4) == [7, 8]
    assert ngram_propose([5, 6, 7], 3, 1, 3) == []  # nothing recurs
    assert ngram_propose([4, 4, 4, 4], 3, 1, 2) == [4, 4]  # an overlapping match


@settings(max_examples=500, deadline=None)
@given(
    # Small ids recur often; ids whose bytes shift into each other (256 = 00 01 00 00, ...)
    # make byte matches that straddle two tokens, which must not count.
    st.lists(st.sampled_from([0, 1, 2, 3, 256, 257, 65536, 16777216]), min_size=1, max_size=40),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 3),
)
def test_ngram_matches_a_naive_search(tokens: list[int], k: int, n_min: int, extra: int) -> None:
    assert ngram_propose(tokens, k, n_min, n_min + extra) == _naive_ngram(
        tokens, k, n_min, n_min + extra
    )


def test_adaptive_k_follows_acceptance_and_pauses_failing_requests() -> None:
    spec = Speculator(SpeculativeConfig("draft", num_tokens=5))
    assert spec.propose("r", [1, 2], 100) == 5  # optimistic at first
    assert spec.propose("r", [1, 2], 3) == 3  # within the request's limit
    for _ in range(6):
        spec.observe("r", 5, 1)
    assert spec.propose("r", [1, 2], 100) == 2  # ~1 accepted a step: k = 2
    for _ in range(10):
        spec.observe("r", 2, 0)
        if spec.state["r"].paused:
            break
    assert spec.state["r"].paused >= 1
    assert spec.propose("r", [1, 2], 100) == 0  # paused
    assert spec.active(8) and not spec.active(9)  # the default max_batch
    fixed = Speculator(SpeculativeConfig("draft", num_tokens=3, adaptive=False))
    fixed.observe("r", 3, 0)
    assert fixed.propose("r", [1], 100) == 3


def _sched(num_blocks: int = 64, **spec: object) -> Scheduler:
    cfg = SpeculativeConfig("ngram", **{"num_tokens": 3, "max_batch": 64, **spec})  # type: ignore[arg-type]
    return Scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        # As the compute plane reports it: never more than the pool holds (a request that
        # outgrows the whole pool could never be re-admitted after preempting itself).
        max_model_len=min(256, (num_blocks - 1) * BS),
        max_num_batched_tokens=64,
        speculator=Speculator(cfg),
    )


def _request(rid: str, prompt: list[int], max_tokens: int = 40) -> Request:
    return Request(rid, prompt, max_tokens, eos_token_ids=frozenset({EOS}))


def test_blocks_follow_the_accepted_length_and_a_stop_cuts_the_accepted_tokens() -> None:
    sched = _sched()
    req = _request("a", [5, 6, 7, 8, 5, 6, 7])
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, {"a": 8})  # prefill; tokens ... 5 6 7 8: "5 6 7 8" recurs
    out = sched.schedule()
    assert out.proposals == {req: [5, 6, 7]}
    # Blocks for the last known token and the 3 proposals' positions: 8 + 3 = 11 -> 3 blocks.
    assert len(sched.block_manager.block_ids("a")) == 3
    assert out.num_tokens == 4
    acc, sampled = {"a": [5, 6]}, {"a": 7}
    sched.update(out, sampled, acc)
    assert req.token_ids[-4:] == [8, 5, 6, 7]
    assert req.num_computed_tokens == len(req.token_ids) - 1
    # An EOS among the accepted tokens ends the request there: the lists are cut.
    out = sched.schedule()
    acc, sampled = {"a": [3, EOS, 4]}, {"a": 5}
    proposal = out.proposals[req]
    assert isinstance(proposal, list) and proposal
    finished = sched.update(out, sampled, acc)
    assert finished == [req] and req.status == Status.FINISHED_STOPPED
    assert acc == {"a": [3]} and sampled == {"a": EOS}
    assert req.output_token_ids[-2:] == [3, EOS]


def test_proposals_stop_at_max_tokens() -> None:
    sched = _sched()
    req = _request("a", [1, 2, 1, 2, 1, 2], max_tokens=3)
    sched.add_request(req)
    sched.update(sched.schedule(), {"a": 1})  # 1 output token; 2 more allowed
    out = sched.schedule()
    assert out.proposals[req] == [2]  # one proposal + the sampled token = the 2 left
    finished = sched.update(out, {"a": 1}, {"a": [2]})
    assert finished == [req] and req.status == Status.FINISHED_LENGTH
    assert req.num_output_tokens == 3


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(6, 24))
def test_random_workloads_keep_pages_and_progress_consistent(seed: int, num_blocks: int) -> None:
    """Under pool pressure (preemption) with proposals accepted at random: every request ends,
    the compute plane's view (positions computed, blocks) stays consistent, no block leaks."""
    rng = random.Random(seed)
    sched = _sched(num_blocks=num_blocks)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(1, 4) for _ in range(rng.randrange(2, 10))]
        reqs.append(_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 16)))
        sched.add_request(reqs[-1])
    for _ in range(500):
        if not sched.has_work:
            break
        out = sched.schedule()
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        for req, n in out.scheduled():
            end = req.num_computed_tokens + n
            proposal = out.proposals.get(req)
            k = len(proposal) if isinstance(proposal, list) else 0
            held = len(sched.block_manager.block_ids(req.request_id)) * BS
            assert end + k <= held, "positions beyond the blocks"
            if end == req.num_tokens:
                if isinstance(proposal, list):
                    a = rng.randrange(k + 1)
                    accepted[req.request_id] = proposal[:a]
                sampled[req.request_id] = rng.randrange(0, 4)
        sched.update(out, sampled, accepted)
        for r in sched.running:
            assert r.num_computed_tokens <= r.num_tokens
    assert not sched.has_work
    assert all(r.status.finished for r in reqs)
    assert all(r.num_output_tokens <= r.max_tokens for r in reqs)
    sched.block_manager.check_integrity()
    assert sched.block_manager.num_free_blocks == num_blocks - 1


def test_accepted_tokens_that_fill_a_block_index_it_for_the_prefix_cache() -> None:
    sched = _sched()
    req = _request("a", [5, 6, 7, 5, 6, 7])
    sched.add_request(req)
    sched.update(sched.schedule(), {"a": 5})  # tokens 5 6 7 5 | 6 7 5
    out = sched.schedule()
    assert out.proposals[req] == [6, 7, 5]
    sched.update(out, {"a": 9}, {"a": [6, 7]})  # 5 6 7 5 | 6 7 5 6 | 7 9: block 2 computed
    assert req.num_computed_tokens == 9
    twin = _request("b", [*req.token_ids[:8], 1])
    assert len(sched.block_manager.find_prefix(twin)) == 2  # both full blocks, rightly hashed


def test_no_proposal_takes_the_blocks_other_requests_need() -> None:
    sched = _sched(num_blocks=6)  # 5 usable blocks of 4
    a, b = _request("a", [1, 2, 1, 2, 1, 2, 1]), _request("b", [3, 4, 3, 4, 3, 4, 3])
    for r in (a, b):
        sched.add_request(r)
    sched.update(sched.schedule(), {"a": 2, "b": 4})  # 8 tokens each: 2 blocks each, 1 free
    out = sched.schedule()
    # A proposal would need a block for its positions, leaving fewer than one per running
    # request: neither proposes, and no one is preempted.
    assert out.proposals == {} and sched.num_preemptions == 0
