"""Async scheduling in the scheduler: step k+1 planned before step k's result (advance /
schedule(lookahead=True) / resolve) gives every request the tokens that planning one step
at a time gives, under preemption, stop tokens, max_tokens and stop strings.

The compute plane is simulated here (a unit test of the scheduler): it keeps each
request's tokens as the real one does, appends what it samples, and samples a token that
is a fixed function of the tokens so far, so both schedules must produce the same text.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.request import PENDING_TOKEN, Request, Status
from control_plane.scheduler import Scheduler, SchedulerOutput

BS = 4
EOS = 0
STOP_STRING_TOKEN = 7  # ends a request as a stop string does: after the step's result
VOCAB = 12


def _next_token(tokens: list[int], salt: int) -> int:
    h = salt
    for t in tokens[-3:]:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


@dataclass
class _Step:
    """What the compute plane gets: copied when sent (the scheduler's lists move on)."""

    finished_ids: list[str]
    new: list[tuple[str, list[int], int, int]]  # id, token ids, computed, scheduled
    scheduled: list[tuple[str, int]]


def _snapshot(out: SchedulerOutput) -> _Step:
    new = [
        (
            s.request.request_id,
            list(s.request.token_ids),
            s.num_computed_tokens,
            s.num_scheduled_tokens,
        )
        for s in out.new
    ]
    for _, ids, _, _ in new:
        assert PENDING_TOKEN not in ids, "a placeholder was sent as a token"
    cont = [(r.request_id, 1) for r in out.decodes]
    cont += [(c.request.request_id, c.num_scheduled_tokens) for c in out.continuing]
    return _Step(list(out.finished_ids), new, cont)


class _ComputePlane:
    def __init__(self, salt: int) -> None:
        self.salt = salt
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}  # (its tokens when first sent)
        self.prompt_work = 0  # prompt positions computed, in all

    def run(self, step: _Step) -> dict[str, int]:
        for rid in step.finished_ids:
            self.tokens.pop(rid, None)
            self.computed.pop(rid, None)
        work = []
        for rid, ids, computed, n in step.new:
            assert rid not in self.tokens, f"{rid} sent in full while held"
            self.tokens[rid], self.computed[rid] = ids, computed
            self.prompt_len.setdefault(rid, len(ids))
            work.append((rid, n))
        sampled = {}
        for rid, n in work + step.scheduled:
            toks = self.tokens[rid]
            start = self.computed[rid]
            self.prompt_work += max(0, min(start + n, self.prompt_len[rid]) - start)
            self.computed[rid] += n
            assert self.computed[rid] <= len(toks), f"{rid}: positions past its tokens"
            if self.computed[rid] == len(toks):
                sampled[rid] = tok = _next_token(toks, self.salt)
                toks.append(tok)
        return sampled


def _requests(rng: random.Random, n: int, max_choices: int = 1) -> list[Request]:
    """n streams; with max_choices > 1, each of 1 to max_choices choices ("r3.0", "r3.1",
    ...: the first's prompt forked, as `_add` queues them), max_tokens often 1."""
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
        if max_choices == 1:
            max_tokens = rng.randrange(1, 20)
            reqs.append(Request(f"r{i}", prompt, max_tokens, eos_token_ids=frozenset({EOS})))
            continue
        max_tokens = rng.choice((1, rng.randrange(2, 20)))
        for j in range(rng.randrange(1, max_choices + 1)):
            reqs.append(Request(f"r{i}.{j}", prompt, max_tokens, eos_token_ids=frozenset({EOS})))
    return reqs


def _add(sched: Scheduler, reqs: list[Request]) -> None:
    """Queue requests as the engine queues a stream's choices: "r3.1" forks "r3.0"."""
    firsts: dict[str, Request] = {}
    for r in reqs:
        first = firsts.setdefault(r.request_id.split(".")[0], r)
        sched.add_request(r, fork_of=None if first is r else first)


def _scheduler(num_blocks: int, prefix_caching: bool = True) -> Scheduler:
    return Scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_model_len=(num_blocks - 1) * BS,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=prefix_caching,
    )


def _stop_strings(sched: Scheduler, sampled: dict[str, int]) -> None:
    """The output processor's part: a stop string in a result ends its request then."""
    for rid, token in sampled.items():
        req = sched.requests.get(rid)
        if token == STOP_STRING_TOKEN and req is not None and req.status is Status.RUNNING:
            sched.finish(rid, Status.FINISHED_STOPPED)


def _run_sync(
    reqs: list[Request], num_blocks: int, salt: int, cp: _ComputePlane | None = None
) -> Scheduler:
    sched = _scheduler(num_blocks, prefix_caching=cp is None)
    cp = cp or _ComputePlane(salt)
    _add(sched, reqs)
    for _ in range(2000):
        if not sched.has_work:
            break
        out = sched.schedule()
        sampled = cp.run(_snapshot(out))
        sched.update(out, sampled)
        _stop_strings(sched, sampled)
    return sched


def _run_async(
    reqs: list[Request],
    num_blocks: int,
    salt: int,
    ahead: int = 1,
    cp: _ComputePlane | None = None,
) -> tuple[Scheduler, int]:
    """As the control plane's loop: up to `ahead` steps planned beyond the one awaited.
    (Given a compute plane to count its work, the prefix cache is off.)"""
    sched = _scheduler(num_blocks, prefix_caching=cp is None)
    cp = cp or _ComputePlane(salt)
    _add(sched, reqs)
    in_flight: deque[tuple[SchedulerOutput, _Step]] = deque()
    overlapped = 0
    for _ in range(4000):
        if not (sched.has_work or in_flight):
            break
        if not in_flight or (len(in_flight) <= ahead and not sched.needs_sync):
            out = sched.schedule(lookahead=bool(in_flight))
            if not out.empty:
                overlapped += bool(in_flight)
                in_flight.append((out, _snapshot(out)))
                sched.advance(out)
                if len(in_flight) <= ahead:
                    continue  # plan the next one before the result of those in flight
        assert in_flight, "work left, nothing planned and nothing in flight"
        done, step = in_flight.popleft()
        sampled = cp.run(step)
        sched.resolve(done, sampled)
        _stop_strings(sched, sampled)
        for r in sched.running:
            assert r.token_ids.count(PENDING_TOKEN) == r.num_pending <= len(in_flight)
    return sched, overlapped


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(5, 40), st.integers(1, 3))
def test_async_schedule_gives_the_tokens_of_the_sync_one(
    seed: int, num_blocks: int, ahead: int
) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, 8)
    salt = rng.randrange(1000)
    sync_reqs, async_reqs = _requests(random.Random(seed), n), _requests(random.Random(seed), n)
    _run_sync(sync_reqs, num_blocks, salt)
    sched, _ = _run_async(async_reqs, num_blocks, salt, ahead)
    assert not sched.has_work
    for a, b in zip(sync_reqs, async_reqs, strict=True):
        assert b.status.finished and b.num_pending == 0
        assert PENDING_TOKEN not in b.token_ids
        assert (b.output_token_ids, b.status) == (a.output_token_ids, a.status), a.request_id
    sched.block_manager.check_integrity()
    assert sched.block_manager.num_free_blocks == num_blocks - 1


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 3))
def test_n_choices_planned_ahead_compute_each_prompt_once(seed: int, ahead: int) -> None:
    """n > 1: the other choices fork the first's prompt blocks planned ahead as one step at
    a time (also when the first's first token ends it): the same prompt positions are
    computed, and the same tokens come. A pool that never preempts; the prefix cache off,
    so sharing comes from the forks alone."""
    rng = random.Random(seed)
    n = rng.randrange(1, 6)
    salt = rng.randrange(1000)
    sync_reqs = _requests(random.Random(seed), n, max_choices=3)
    async_reqs = _requests(random.Random(seed), n, max_choices=3)
    sync_cp, async_cp = _ComputePlane(salt), _ComputePlane(salt)
    sync = _run_sync(sync_reqs, 64, salt, sync_cp)
    sched, _ = _run_async(async_reqs, 64, salt, ahead, async_cp)
    assert sync.num_preemptions == sched.num_preemptions == 0
    for a, b in zip(sync_reqs, async_reqs, strict=True):
        assert (b.output_token_ids, b.status) == (a.output_token_ids, a.status), a.request_id
    assert async_cp.prompt_work == sync_cp.prompt_work
    sched.block_manager.check_integrity()
    assert sched.block_manager.num_free_blocks == 63


@pytest.mark.parametrize(("ahead", "seed", "num_blocks"), [(1, 3, 9), (2, 4, 8)])
def test_steps_overlap_and_preemption_still_happens(ahead: int, seed: int, num_blocks: int) -> None:
    """A tight pool: lookahead steps leave requests short of blocks (needs_sync), the
    next planned step preempts; most steps are still planned with one in flight."""
    reqs, sync_reqs = _requests(random.Random(seed), 7), _requests(random.Random(seed), 7)
    sync = _run_sync(sync_reqs, num_blocks, salt=5)
    sched, overlapped = _run_async(reqs, num_blocks, salt=5, ahead=ahead)
    assert sync.num_preemptions > 0 and sched.num_preemptions > 0
    assert overlapped > 10
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in sync_reqs]


def test_eos_in_flight_drops_the_next_steps_token() -> None:
    """A request that samples EOS in step k was planned into step k+1 already: the token
    step k+1 samples for it is dropped and never reaches it or its stream."""
    sched = _scheduler(16)
    req = Request("a", [1, 2, 3], 10, eos_token_ids=frozenset({EOS}))
    sched.add_request(req)
    out1 = sched.schedule()
    sched.advance(out1)  # prefill: samples a token (pending)
    assert req.token_ids == [1, 2, 3, PENDING_TOKEN] and req.num_pending == 1
    out2 = sched.schedule(lookahead=True)
    assert out2.decodes == [req]  # decodes the pending token (the compute plane has it)
    sched.advance(out2)
    assert req.token_ids == [1, 2, 3, PENDING_TOKEN, PENDING_TOKEN]
    assert sched.resolve(out1, {"a": EOS}) == [req]
    assert req.status is Status.FINISHED_STOPPED and req.token_ids == [1, 2, 3, EOS]
    sampled = {"a": 5}
    assert sched.resolve(out2, sampled) == [] and sampled == {}  # the overshoot: dropped
    assert sched.schedule().finished_ids == ["a"]
    sched.block_manager.check_integrity()


def test_max_tokens_reached_by_a_pending_token_is_not_planned_again() -> None:
    sched = _scheduler(16)
    req = Request("a", [1, 2], 2, eos_token_ids=frozenset({EOS}))
    sched.add_request(req)
    out1 = sched.schedule()
    sched.advance(out1)
    out2 = sched.schedule(lookahead=True)
    sched.advance(out2)  # the second (last) token is pending now
    assert req.num_pending == 2
    assert sched.schedule(lookahead=True).empty  # nothing left to plan for it
    sched.resolve(out1, {"a": 4})
    assert sched.resolve(out2, {"a": 5}) == [req]
    assert req.output_token_ids == [4, 5] and req.status is Status.FINISHED_LENGTH


@pytest.mark.parametrize("where", ["abort", "stop_string"])
def test_ending_a_request_with_steps_in_flight_forgets_their_tokens(where: str) -> None:
    sched = _scheduler(16)
    req = Request("a", [1, 2, 3], 10, eos_token_ids=frozenset({EOS}))
    sched.add_request(req)
    out1 = sched.schedule()
    sched.advance(out1)
    sched.resolve(out1, {"a": 4})
    out2 = sched.schedule()
    sched.advance(out2)
    out3 = sched.schedule(lookahead=True)
    sched.advance(out3)
    assert req.token_ids == [1, 2, 3, 4, PENDING_TOKEN, PENDING_TOKEN]
    if where == "stop_string":
        req.drop_last(1)  # the output processor cuts the token after a stop string
        assert req.token_ids == [1, 2, 3, PENDING_TOKEN, PENDING_TOKEN]
        sched.finish("a", Status.FINISHED_STOPPED)
    else:
        sched.abort("a")
    assert req.token_ids == ([1, 2, 3] if where == "stop_string" else [1, 2, 3, 4])
    assert req.num_pending == 0
    s2, s3 = {"a": 5}, {"a": 6}
    sched.resolve(out2, s2)
    sched.resolve(out3, s3)
    assert s2 == s3 == {}
    sched.block_manager.check_integrity()
    assert sched.block_manager.num_free_blocks == 15


def test_two_steps_ahead_index_only_known_tokens_for_the_prefix_cache() -> None:
    """With two steps planned ahead, a block can be counted as computed while its last
    position still holds the placeholder of a step in flight: it is indexed for the
    prefix cache when its token is known, under the tokens' own hash, so a later prompt
    that repeats the request's text finds it."""
    sched = _scheduler(16)
    req = Request("a", [1, 2], 3, eos_token_ids=frozenset({EOS}))
    sched.add_request(req)
    outs = []
    for lookahead in (False, True, True):  # prefill, then two decodes planned ahead
        outs.append(out := sched.schedule(lookahead=lookahead))
        sched.advance(out)
    assert req.token_ids == [1, 2, PENDING_TOKEN, PENDING_TOKEN, PENDING_TOKEN]
    assert req.num_computed_tokens == 4  # block 0 (positions 0-3) counted as computed
    sched.resolve(outs[0], {"a": 3})
    assert req.token_ids == [1, 2, 3, PENDING_TOKEN, PENDING_TOKEN]
    bm = sched.block_manager
    assert bm._num_hashed["a"] == 0, "a block holding a placeholder was indexed"
    sched.resolve(outs[1], {"a": 4})
    assert bm._num_hashed["a"] == 1  # its tokens known now: [1, 2, 3, 4]
    assert sched.resolve(outs[2], {"a": 5}) == [req]  # max_tokens
    assert req.output_token_ids == [3, 4, 5]
    sched.schedule()  # (frees its blocks)
    again = Request("b", [1, 2, 3, 4, 5, 6], 1, eos_token_ids=frozenset({EOS}))
    sched.add_request(again)
    out = sched.schedule()
    assert out.new[0].num_computed_tokens == BS, "the prefix cache missed the known block"
    bm.check_integrity()


@pytest.mark.parametrize("ahead", [False, True])
def test_a_prompt_only_request_ends_by_length_with_no_output(ahead: bool) -> None:
    """GenerationParams.prompt_only: the token sampled when the prompt is computed (EOS
    here, which would stop any other request) is taken back; the request ends by length
    with no output and nothing more is planned for it, planned ahead or not."""
    sched = _scheduler(16)
    req = Request("a", [1, 2, 3, 4, 5], 1, eos_token_ids=frozenset({EOS}), prompt_only=True)
    sched.add_request(req)
    out = sched.schedule()
    if ahead:
        sched.advance(out)
        assert sched.schedule(lookahead=True).empty  # its pending token is its last
        assert sched.resolve(out, {"a": EOS}) == [req]
    else:
        assert sched.update(out, {"a": EOS}) == [req]
    assert req.status is Status.FINISHED_LENGTH and req.stop_reason is None
    assert req.token_ids == [1, 2, 3, 4, 5] and req.num_output_tokens == 0
    assert sched.schedule().finished_ids == ["a"]
    sched.block_manager.check_integrity()
    assert sched.block_manager.num_free_blocks == 15


@pytest.mark.parametrize("end", ["max_tokens", "eos", "prompt_only"])
@pytest.mark.parametrize("ahead", [False, True])
def test_n_siblings_fork_a_first_choice_that_its_first_token_ends(end: str, ahead: bool) -> None:
    """n > 1: the other choices fork the first's prompt blocks when its prompt is computed,
    also when the token sampled then ends it (max_tokens 1, EOS, a prompt-only request);
    planned ahead, they were put back to compute the prompt again (its blocks freed first)."""
    # Prefix caching off: any sharing must come from the fork.
    sched = Scheduler(num_blocks=20, block_size=BS, max_model_len=40, enable_prefix_caching=False)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    kw = {"eos_token_ids": frozenset({EOS}), "prompt_only": end == "prompt_only"}
    max_tokens = 1 if end != "eos" else 5
    first, *siblings = [Request(f"c{i}", prompt, max_tokens, **kw) for i in range(3)]
    sched.add_request(first)
    for s in siblings:
        sched.add_request(s, fork_of=first)
    out = sched.schedule()
    assert [s.request.request_id for s in out.new] == ["c0"]  # siblings wait for the prompt
    parent_blocks = list(out.new[0].block_ids)
    token = EOS if end == "eos" else 5
    if ahead:
        sched.advance(out)
        nxt = sched.schedule(lookahead=True)  # (EOS: its decode; else nothing to plan)
        sched.advance(nxt)
        assert sched.resolve(out, {"c0": token}) == [first]
    else:
        assert sched.update(out, {"c0": token}) == [first]
    out = sched.schedule()
    forked = {s.request.request_id: s for s in out.new}
    assert set(forked) == {"c1", "c2"}
    for s in forked.values():  # the prompt's full blocks shared, its tail recomputed
        assert s.num_computed_tokens == 8 and s.num_scheduled_tokens == 2
        assert s.block_ids[:2] == parent_blocks[:2] and s.block_ids[2] not in parent_blocks[:2]
    assert forked["c1"].block_ids[2] != forked["c2"].block_ids[2]
    assert out.num_tokens == 4  # not 20: the prompt is computed once
    assert [sched.block_manager.pool.blocks[b].ref_cnt for b in parent_blocks[:2]] == [2, 2]
    sched.block_manager.check_integrity()


@pytest.mark.parametrize("end", ["max_tokens", "eos", "prompt_only"])
@pytest.mark.parametrize("ahead", [False, True])
def test_a_request_its_first_token_ends_leaves_its_prompt_in_the_prefix_cache(
    end: str, ahead: bool
) -> None:
    """The full blocks of a request's prompt are indexed for the prefix cache when the
    step that computed them comes back, also when the token sampled then ends it: planned
    ahead, resolve freed it unindexed, so a later request with that prompt (the next
    max_tokens 1 or scoring request over one context) computed it all again."""
    sched = _scheduler(16)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    kw = {"eos_token_ids": frozenset({EOS}), "prompt_only": end == "prompt_only"}
    req = Request("a", prompt, 1 if end != "eos" else 5, **kw)
    sched.add_request(req)
    out = sched.schedule()
    token = EOS if end == "eos" else 5
    if ahead:
        sched.advance(out)
        sched.advance(sched.schedule(lookahead=True))  # (EOS: its decode; else nothing)
        assert sched.resolve(out, {"a": token}) == [req]
    else:
        assert sched.update(out, {"a": token}) == [req]
    again = Request("b", [*prompt, 11], 1, eos_token_ids=frozenset({EOS}))
    sched.add_request(again)
    out = sched.schedule()
    assert [(s.request, s.num_computed_tokens) for s in out.new] == [(again, 2 * BS)]
    assert again.num_cached_tokens == 2 * BS
    sched.block_manager.check_integrity()
