"""Scheduler properties under random workloads, with the compute plane simulated in the test."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.plane import ComputePlane
from control_plane.request import Request, Status
from control_plane.scheduler import (
    AdmissionError,
    QueueFullError,
    Scheduler,
    SchedulerOutput,
    _wire_bytes,
)
from hetero_proto import compute_pb2 as cpb

BS = 4
EOS = 0


class FakeCompute:
    """Mirrors what the compute plane keeps: page tables and tokens, rebuilt from the diffs,
    and the KV cache: each slot holds the K/V of the whole prefix up to its position."""

    def __init__(self, rng: random.Random, window: int | None = None) -> None:
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.rng = rng
        # With a sliding window a table keeps the ids of blocks given back, which another
        # request may then write: no check of shared writes then.
        self.window = window

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        for rid in out.finished_ids:
            self.tables.pop(rid)
            self.computed.pop(rid)
        for s in out.new:
            assert s.request.request_id not in self.tables, "sent in full twice"
            self.tables[s.request.request_id] = list(s.block_ids)
            self.computed[s.request.request_id] = s.num_computed_tokens
            # What it starts with (a prefix hit, a fork) is the K/V of its own prefix.
            for pos in range(s.num_computed_tokens):
                got = self.kv.get((s.block_ids[pos // BS], pos % BS))
                assert got == tuple(s.request.token_ids[: pos + 1]), "reuses wrong K/V"
        for c in out.continuing:
            self.tables[c.request.request_id].extend(c.new_block_ids)
        sampled = {}
        for req, n in out.scheduled():
            rid = req.request_id
            table = self.tables[rid]
            assert self.computed[rid] + n <= len(table) * BS, "tokens beyond the blocks"
            for pos in range(self.computed[rid], self.computed[rid] + n):
                block = table[pos // BS]
                others = (t for r, t in self.tables.items() if r != rid)
                assert self.window or not any(block in t for t in others), f"write into {block}"
                self.kv[block, pos % BS] = tuple(req.token_ids[: pos + 1])
            self.computed[rid] += n
            if self.computed[rid] == req.num_tokens:
                sampled[rid] = self.rng.randrange(0, 12)  # token 0 is EOS
        return sampled


def _check_step(sched: Scheduler, out: SchedulerOutput, compute: FakeCompute) -> None:
    scheduled = out.scheduled()
    assert out.num_tokens == sum(n for _, n in scheduled) <= sched.max_num_batched_tokens
    assert len(scheduled) <= sched.max_num_seqs
    assert all(n >= 1 for _, n in scheduled)
    # Decodes (one token left) come before prefills among continuing requests.
    kinds = [c.request.num_tokens - c.request.num_computed_tokens == 1 for c in out.continuing]
    assert kinds == sorted(kinds, reverse=True)
    # Every request is in exactly one place.
    waiting = {r.request_id for r in sched.waiting}
    running = {r.request_id for r in sched.running}
    assert not waiting & running
    pending = {r.request_id for sibs in sched.pending_forks.values() for r in sibs}
    assert not (waiting | running) & pending
    assert waiting | running | pending == set(sched.requests)
    sched.block_manager.check_integrity()
    # The compute plane's view, rebuilt from diffs alone, equals the block manager's tables.
    for rid, table in compute.tables.items():
        assert table == sched.block_manager.block_ids(rid), rid


def _run(
    sched: Scheduler,
    requests: list[Request],
    seed: int,
    compute: FakeCompute | None = None,
    forks: dict[str, Request] | None = None,
) -> None:
    """Run to the end; `forks` maps a choice's id to its first choice (n > 1)."""
    compute = compute or FakeCompute(random.Random(seed))
    for r in requests:
        sched.add_request(r, fork_of=(forks or {}).get(r.request_id))
    for _ in range(5000):
        if not sched.has_work:
            break
        out = sched.schedule()
        sampled = compute.step(out)
        _check_step(sched, out, compute)
        sched.update(out, sampled)
    else:
        pytest.fail("no progress: livelock")
    assert all(r.status.finished for r in requests)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Scheduler, list[Request], int]:
    num_blocks = draw(st.integers(8, 40))
    max_len = (num_blocks - 1) * BS
    sched = Scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_model_len=max_len,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
    )
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        n = draw(st.integers(1, max(1, min(30, max_len - 1))))
        vocab = draw(st.sampled_from([2, 50]))
        reqs.append(
            Request(
                f"r{i}",
                [1 + (j * 13 + i * draw(st.integers(0, 1))) % vocab for j in range(n)],
                max_tokens=draw(st.integers(1, max(1, min(12, max_len - n)))),
                min_tokens=draw(st.integers(0, 3)),
                ignore_eos=draw(st.booleans()),
                eos_token_ids=frozenset({EOS}),
                stop_token_ids=frozenset(draw(st.sets(st.integers(1, 11), max_size=2))),
            )
        )
    return sched, reqs, draw(st.integers(0, 1000))


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_random_workloads_finish_within_budgets(w: tuple[Scheduler, list[Request], int]) -> None:
    sched, reqs, seed = w
    _run(sched, reqs, seed)
    for r in reqs:
        out = r.output_token_ids
        # Finished iff a stop condition holds, and for the right reason.
        if r.status == Status.FINISHED_LENGTH:
            assert len(out) == r.max_tokens
            assert not any(t in r.stop_token_ids for t in out[r.min_tokens :])
        else:
            assert r.status == Status.FINISHED_STOPPED
            assert len(out) > r.min_tokens
            last = out[-1]
            assert last in r.stop_token_ids or (last == EOS and not r.ignore_eos)
            assert len(out) <= r.max_tokens
        # Nothing stopped it earlier.
        for t in out[r.min_tokens : -1]:
            assert t not in r.stop_token_ids and (r.ignore_eos or t != EOS)
    bm = sched.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.pool.num_usable


@st.composite
def n_workloads(
    draw: st.DrawFn,
) -> tuple[Scheduler, list[Request], dict[str, Request], int]:
    """`workloads` where some requests are n > 1: choices forked from a first one."""
    sched, firsts, seed = draw(workloads())
    reqs: list[Request] = []
    forks: dict[str, Request] = {}
    for first in firsts:
        reqs.append(first)
        for j in range(draw(st.integers(0, 3))):
            choice = Request(
                f"{first.request_id}.{j}",
                list(first.prompt_token_ids),
                max_tokens=draw(st.integers(1, first.max_tokens)),
                ignore_eos=draw(st.booleans()),
                eos_token_ids=frozenset({EOS}),
            )
            reqs.append(choice)
            forks[choice.request_id] = first
    return sched, reqs, forks, seed


@settings(max_examples=200, deadline=None)
@given(n_workloads())
def test_random_workloads_with_n_choices_finish_and_free_every_block(
    w: tuple[Scheduler, list[Request], dict[str, Request], int],
) -> None:
    sched, reqs, forks, seed = w
    _run(sched, reqs, seed, forks=forks)
    bm = sched.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.pool.num_usable
    assert not sched.pending_forks and not sched.requests


def test_forked_choices_waiting_behind_a_preempted_request_give_back_their_blocks() -> None:
    """P's second choice C forks P's prompt blocks and waits; R, preempted, goes back in
    front of it. Once P ends nothing runs, and C's blocks were the ones R lacked: the
    queue waited forever (no step, R and C never finished). C now gives them back."""
    sched = Scheduler(num_blocks=9, block_size=BS, max_model_len=32, max_num_batched_tokens=64)
    p = Request("P", list(range(1, 13)), max_tokens=4, ignore_eos=True)
    c = Request("C", list(range(1, 13)), max_tokens=4, ignore_eos=True)
    r = Request("R", list(range(20, 40)), max_tokens=12, ignore_eos=True)
    _run(sched, [p, c, r], seed=0, forks={"C": p})
    assert sched.num_preemptions > 0
    assert [x.num_output_tokens for x in (p, c, r)] == [4, 4, 12]
    assert sched.block_manager.num_free_blocks == 8


def test_tight_pool_preempts_and_still_finishes() -> None:
    sched = Scheduler(num_blocks=9, block_size=BS, max_model_len=32, max_num_batched_tokens=64)
    reqs = [Request(f"r{i}", [5 + i] * 10, max_tokens=20, ignore_eos=True) for i in range(4)]
    _run(sched, reqs, seed=1)
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 20 and r.status == Status.FINISHED_LENGTH for r in reqs)
    assert any(r.num_preemptions for r in reqs)


def test_preemption_keeps_generated_tokens_and_resends_in_full() -> None:
    sched = Scheduler(num_blocks=5, block_size=BS, max_model_len=16, max_num_batched_tokens=64)
    a = Request("a", [1, 2, 3], max_tokens=13, ignore_eos=True)
    b = Request("b", [4, 5, 6], max_tokens=13, ignore_eos=True)
    compute = FakeCompute(random.Random(0))
    sched.add_request(a)
    sched.add_request(b)
    preempted_with: list[int] = []
    for _ in range(200):
        if not sched.has_work:
            break
        out = sched.schedule()
        for s in out.new:
            if s.request.num_preemptions:
                preempted_with.append(s.request.num_output_tokens)
                # Resent in full: every known token, none computed (no full cached block hit needed).
                assert (
                    s.request.token_ids[: s.request.num_prompt_tokens] == s.request.prompt_token_ids
                )
        sampled = compute.step(out)
        _check_step(sched, out, compute)
        sched.update(out, sampled)
    assert sched.num_preemptions > 0 and preempted_with and max(preempted_with) > 0
    assert a.num_output_tokens == b.num_output_tokens == 13


def test_admission_errors() -> None:
    sched = Scheduler(num_blocks=9, block_size=BS, max_model_len=32, max_waiting=1)
    with pytest.raises(AdmissionError, match="32"):
        sched.check_admission(30, 3)
    with pytest.raises(AdmissionError, match="empty"):
        sched.check_admission(0, 3)
    sched.check_admission(1, 3)
    sched.add_request(Request("ok", [1], max_tokens=3))
    with pytest.raises(QueueFullError):
        sched.check_admission(1, 3)
    with pytest.raises(ValueError, match="duplicate"):  # a real check, also under -O
        sched.add_request(Request("ok", [2], max_tokens=3))


def test_abort_frees_at_once() -> None:
    sched = Scheduler(num_blocks=9, block_size=BS, max_model_len=32)
    r = Request("a", list(range(1, 11)), max_tokens=5)
    sched.add_request(r)
    out = sched.schedule()
    assert sched.block_manager.num_free_blocks == 5
    sched.abort("a")
    assert sched.block_manager.num_free_blocks == 8
    sched.block_manager.check_integrity()
    nxt = sched.schedule()
    assert nxt.finished_ids == ["a"] and out.new


def test_n_siblings_fork_the_prompt_blocks() -> None:
    # Prefix caching off: any sharing must come from the fork.
    sched = Scheduler(num_blocks=20, block_size=BS, max_model_len=40, enable_prefix_caching=False)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    first = Request("c0", prompt, max_tokens=3, ignore_eos=True)
    sched.add_request(first)
    siblings = [Request(f"c{i}", prompt, max_tokens=3, ignore_eos=True) for i in (1, 2)]
    for s in siblings:
        sched.add_request(s, fork_of=first)
    compute = FakeCompute(random.Random(0))
    out = sched.schedule()
    assert [s.request.request_id for s in out.new] == ["c0"]  # siblings wait for the prompt
    parent_blocks = list(out.new[0].block_ids)
    sched.update(out, compute.step(out))
    out = sched.schedule()
    forked = {s.request.request_id: s for s in out.new}
    assert set(forked) == {"c1", "c2"}
    for s in forked.values():
        assert s.num_computed_tokens == 8 and s.num_scheduled_tokens == 2
        assert s.block_ids[:2] == parent_blocks[:2] and s.block_ids[2] not in parent_blocks
    assert [sched.block_manager.pool.blocks[b].ref_cnt for b in parent_blocks[:2]] == [3, 3]
    sched.update(out, compute.step(out))
    _run(sched, [], seed=0, compute=compute)
    assert all(r.num_output_tokens == 3 for r in [first, *siblings])
    assert sched.block_manager.num_free_blocks == 19


def test_aborting_the_first_choice_releases_its_siblings() -> None:
    sched = Scheduler(num_blocks=20, block_size=BS, max_model_len=40)
    first = Request("c0", [1, 2, 3], max_tokens=2)
    sib = Request("c1", [1, 2, 3], max_tokens=2)
    sched.add_request(first)
    sched.add_request(sib, fork_of=first)
    sched.abort("c0")
    assert list(sched.waiting) == [sib]
    sched.abort("c1")
    assert not sched.has_work or sched.schedule().finished_ids == []


def _decode_behind_prefill(num_blocks: int, budget: int, p_first_chunk: int) -> Scheduler:
    """D decodes in its one block; P, still prefilling, is ahead of D in admission order.

    Admission order puts a prefill behind the decodes admitted before it; the running
    list is reordered by hand so that the preemption victim (the last admitted, D) is
    planned earlier in the step than the request that needs a block (P).
    """
    sched = Scheduler(
        num_blocks=num_blocks, block_size=BS, max_model_len=64, max_num_batched_tokens=budget
    )
    d = Request("D", [1, 2, 3], max_tokens=10, ignore_eos=True)
    p = Request("P", list(range(10, 22)), max_tokens=4, ignore_eos=True)
    sched.add_request(d)
    sched.add_request(p)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_scheduled_tokens) for s in out.new] == [
        ("D", 3),
        ("P", p_first_chunk),
    ]
    sched.update(out, {"D": 7})
    sched.running.reverse()
    return sched


def test_preempting_a_decode_planned_in_its_blocks_takes_it_out_of_the_step() -> None:
    sched = _decode_behind_prefill(num_blocks=4, budget=8, p_first_chunk=5)
    assert sched.block_manager.block_ids("D") == [1] and sched.block_manager.num_free_blocks == 0
    out = sched.schedule()
    # D fit in its block and was planned; P's chunk of 7 needed a third block: D gave its own.
    assert out.decodes == [] and out.finished_ids == ["D"]
    assert [
        (c.request.request_id, c.new_block_ids, c.num_scheduled_tokens) for c in out.continuing
    ] == [("P", [1], 7)]
    assert out.num_tokens == 7 and out.new == []
    assert sched.requests["D"].status is Status.WAITING and list(sched.waiting) == [
        sched.requests["D"]
    ]
    sched.block_manager.check_integrity()


def test_preempting_a_decode_that_got_a_block_this_step_returns_it() -> None:
    sched = _decode_behind_prefill(num_blocks=4, budget=4, p_first_chunk=1)
    out = sched.schedule()  # D decodes in its block, P computes 3 more in its own
    assert out.decodes == [sched.requests["D"]] and out.num_tokens == 4
    sched.update(out, {"D": 8})
    out = sched.schedule()
    # D's next token needs a new block (3); then P needs one too and none is free: D,
    # the last admitted, is preempted, and its blocks go back, the empty one first.
    assert out.decodes == [] and out.finished_ids == ["D"]
    assert [
        (c.request.request_id, c.new_block_ids, c.num_scheduled_tokens) for c in out.continuing
    ] == [("P", [3], 3)]
    assert out.num_tokens == 3
    sched.block_manager.check_integrity()


@pytest.mark.parametrize("window", [None, 5])
def test_a_sliding_window_gives_back_blocks_instead_of_preempting(window: int | None) -> None:
    """Two requests of 30 tokens need 8 blocks of 4 each; the pool has 8. Without a window
    one is preempted; with every layer's window at 5 each holds ~3 and neither is. The
    blocks covering what a request's next query sees are never another request's."""
    sched = Scheduler(
        num_blocks=9, block_size=BS, max_model_len=32, max_num_batched_tokens=64,
        sliding_window=window,
    )  # fmt: skip
    reqs = [Request(f"r{i}", [5 + i] * 10, max_tokens=20, ignore_eos=True) for i in range(2)]
    compute = FakeCompute(random.Random(0), window)
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        out = sched.schedule()
        sampled = compute.step(out)
        _check_step(sched, out, compute)
        sched.update(out, sampled)
        seen: dict[int, str] = {}
        for req in sched.running:
            table = sched.block_manager.block_ids(req.request_id)
            first = max(0, req.num_computed_tokens - (window or 10**9) + 1) // BS
            for b in table[first:]:
                assert seen.setdefault(b, req.request_id) == req.request_id, f"block {b}"
    assert all(r.num_output_tokens == 20 for r in reqs)
    assert (sched.num_preemptions > 0) == (window is None)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_queries_count_lookups_once_per_request(caching: bool) -> None:
    """hetero_prefix_cache_queries/hits (as vLLM's prefix_cache_queries/hits): a request's
    prompt tokens at its first admission and the cached ones it found. A request that
    skips the lookup (prompt logprobs) or a pool without caching is no query (it counted
    as a query with no hit, lowering the hit rate), and a preempted request re-admitted
    is not counted again (it mostly finds its own blocks)."""
    sched = Scheduler(num_blocks=7, block_size=BS, max_model_len=24, enable_prefix_caching=caching)
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    compute = FakeCompute(random.Random(0))
    _run(sched, [Request("a", prompt, max_tokens=1, ignore_eos=True)], seed=0, compute=compute)
    kv = sched.block_manager.stats()
    assert (kv.prefix_queries, kv.prefix_hits) == ((9, 0) if caching else (0, 0))
    skip = Request("s", prompt, max_tokens=1, ignore_eos=True, skip_prefix_cache=True)
    _run(sched, [skip], seed=0, compute=compute)
    after = sched.block_manager.stats()
    assert (after.prefix_queries, after.prefix_hits) == (kv.prefix_queries, kv.prefix_hits)
    # Two requests that outgrow the pool: one is preempted and re-admitted, counted once.
    reqs = [Request(r, prompt, max_tokens=12, ignore_eos=True) for r in ("b", "c")]
    _run(sched, reqs, seed=0, compute=compute)
    assert sched.num_preemptions > 0
    kv = sched.block_manager.stats()
    assert (kv.prefix_queries, kv.prefix_hits) == ((27, 16) if caching else (0, 0))


def test_a_steps_new_requests_stay_within_the_links_byte_budget() -> None:
    # Requests on one cached prefix compute a token each but are sent in full (every known
    # token, the whole page table): nothing bounded a step's bytes, and enough of them
    # made a StepRequest past protobuf's 2 GiB, which ComputeClient.send could not
    # serialise (every request of the compute plane failed INTERNAL). Scaled down here.
    limit = 48 << 10
    sched = Scheduler(
        num_blocks=2000,
        block_size=BS,
        max_model_len=4000,
        max_num_batched_tokens=4096,
        max_step_new_bytes=limit,
    )
    prefix = list(range(20_000, 21_000))  # (3 bytes an id on the wire)
    sampling = cpb.SamplingParams(temperature=0.5, seed=1)
    sampling.logit_bias.update({i: 1.0 for i in range(100)})

    def request(i: int) -> Request:
        return Request(f"r{i}", [*prefix, i + 1], max_tokens=1, ignore_eos=True, sampling=sampling)

    compute = FakeCompute(random.Random(0))
    _run(sched, [request(-1)], seed=0, compute=compute)  # the prefix is cached
    reqs = [request(i) for i in range(40)]
    for r in reqs:
        sched.add_request(r)
    assert sum(_wire_bytes(r, BS) for r in reqs) > 2 * limit
    steps = 0
    while sched.has_work:
        out = sched.schedule()
        step = ComputePlane._to_step(cast(ComputePlane, SimpleNamespace(_step_id=1)), out)
        assert step.ByteSize() <= limit
        for s, sent in zip(out.new, step.new_requests, strict=True):
            assert _wire_bytes(s.request, BS) >= sent.ByteSize() > 3000
            assert s.num_scheduled_tokens == 1  # (the prefix is a cache hit)
        sampled = compute.step(out)
        _check_step(sched, out, compute)
        sched.update(out, sampled)
        steps += 1
    assert steps >= 3
    assert all(r.status == Status.FINISHED_LENGTH for r in reqs)
