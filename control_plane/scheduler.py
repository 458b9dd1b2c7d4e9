"""Continuous batching: which requests compute how many tokens in the next step.

Per step, within `max_num_batched_tokens` and `max_num_seqs`:
  1. running requests with one token left (decodes), in admission order;
  2. running requests still prefilling (their next chunk);
  3. waiting requests, admitted in order (prefix-cache hit looked up at admission).
When a running request cannot get a block, the most recently admitted running
request is preempted by recompute: its blocks are freed, it goes back to the front
of the waiting queue with its generated tokens kept, and is later re-sent in full.

The output is a diff for the compute plane: requests it does not hold are sent in
full, the others as appended block ids and a token count.

Async scheduling plans step k+1 while step k runs: `advance(k)` counts step k's tokens
as computed and gives each request that samples in it a PENDING_TOKEN (the compute plane
decodes the real one next without being told), `schedule(lookahead=True)` plans over
that, and `resolve(k)` writes the sampled tokens over the placeholders when the result
arrives, ending requests there (EOS, max_tokens); a token a request samples in a step
planned before it ended is dropped. Several steps may be in flight (`--steps-ahead`): a
request then holds one placeholder per step that samples for it. A lookahead step
preempts nothing and proposes nothing: a request that needs a block the pool cannot
give waits, and `needs_sync` asks for the next step to be planned with nothing in
flight.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from control_plane.block_manager import BlockManager, KVCacheStats
from control_plane.request import PENDING_TOKEN, Request, Status
from control_plane.speculative import Speculator
from hetero_common.limits import STEP_NEW_REQUEST_BYTES


class AdmissionError(ValueError):
    """The request can never run (e.g. longer than max_model_len)."""


class QueueFullError(RuntimeError):
    """The waiting queue is full; retry later."""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """One reading of the scheduler and its KV pool, for metrics and ModelInfo."""

    num_running: int
    num_waiting: int
    num_preemptions: int  # ever
    kv: KVCacheStats


@dataclass(slots=True)
class NewScheduled:
    request: Request
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class ContinuingScheduled:
    request: Request
    new_block_ids: list[int]
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    new: list[NewScheduled] = field(default_factory=list)
    continuing: list[ContinuingScheduled] = field(default_factory=list)
    # Requests the compute plane holds that compute one token in the blocks they hold:
    # the steady decode, which needs no record of its own (the compute plane gets ids).
    decodes: list[Request] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # the compute plane drops these first
    num_tokens: int = 0
    # Speculative decoding: decoding requests that verify proposals this step (continuing,
    # one token scheduled): the proposed tokens (ngram) or how many the draft model makes.
    proposals: dict[Request, list[int] | int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.new or self.continuing or self.decodes or self.finished_ids)

    def scheduled(self) -> list[tuple[Request, int]]:
        """Every scheduled request with its token count: decodes, then new, then continuing."""
        pairs = [(r, 1) for r in self.decodes]
        pairs += [(s.request, s.num_scheduled_tokens) for s in self.new]
        return pairs + [(s.request, s.num_scheduled_tokens) for s in self.continuing]


def _num_proposed(proposal: list[int] | int) -> int:
    return proposal if isinstance(proposal, int) else len(proposal)


def _wire_bytes(req: Request, block_size: int) -> int:
    """At least the bytes of `req` sent in full in a StepRequest (NewRequest): every known
    token and its whole page table (varints, up to 5 bytes each), its sampling parameters
    and strings, a bound on the fields' tags and lengths, and its grammar's mask (a
    TokenMask, when it samples in the step)."""
    ids = len(req.token_ids)
    sampling = req.sampling.ByteSize() if req.sampling is not None else 0
    if req.grammar is not None and req.grammar.mask is not None:
        sampling += req.grammar.mask.ByteSize() + 64
    strings = 4 * len(req.request_id) + len(req.traceparent)  # (UTF-8; the trace's ASCII)
    return 5 * (ids + ids // block_size + 1) + sampling + strings + 64


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_waiting: int = 1024,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        speculator: Speculator | None = None,
        max_step_new_bytes: int = STEP_NEW_REQUEST_BYTES,
    ) -> None:
        # sliding_window: every layer of the model sees only that many latest positions.
        self.block_manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching, sliding_window
        )
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.max_step_new_bytes = max_step_new_bytes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self._dropped: list[str] = []  # ids the compute plane must forget in the next step
        # n > 1: sibling choices wait here until the first choice's prompt is computed,
        # then fork its prompt blocks instead of computing the prompt again.
        self.pending_forks: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self.speculator = speculator
        self.needs_sync = False  # a lookahead step left a request waiting for blocks

    # ------------------------------------------------------------------ intake
    def check_admission(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Whether a request of this size can be queued now: the one admission check.

        Raises AdmissionError (it can never run) or QueueFullError (retry later)."""
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens == 0:
            raise AdmissionError("the prompt is empty")
        if total > self.max_model_len:
            raise AdmissionError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds the maximum context length of {self.max_model_len} tokens"
            )
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")

    def add_request(self, req: Request, fork_of: Request | None = None) -> None:
        """Queue a request that passed `check_admission`; with `fork_of`, it shares that
        request's prompt blocks (n > 1). A request id already queued or running is refused
        (ValueError): ids key the page tables."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        if fork_of is not None and fork_of.request_id in self.requests:
            assert fork_of.token_ids[: fork_of.num_prompt_tokens] == req.prompt_token_ids
            self.pending_forks.setdefault(fork_of.request_id, []).append(req)
        else:
            self.waiting.append(req)

    def finish(self, request_id: str, status: Status) -> Request | None:
        """End a request now (abort, stop string): its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.speculator is not None:
            self.speculator.forget(request_id)
        siblings = self.pending_forks.pop(request_id, [])
        self.waiting.extendleft(reversed(siblings))  # they compute their own prompt now
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            for waiting_siblings in self.pending_forks.values():
                if req in waiting_siblings:
                    waiting_siblings.remove(req)
        req.drop_pending()  # the steps in flight sample for it in vain
        self._release(req)
        req.status = status
        return req

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, Status.FINISHED_ABORTED)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._dropped)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            len(self.running), len(self.waiting), self.num_preemptions, self.block_manager.stats()
        )

    # ---------------------------------------------------------------- schedule
    def schedule(self, admit: bool = True, lookahead: bool = False) -> SchedulerOutput:
        """Plan one step. With `admit` False, running requests go on but none starts.
        With `lookahead`, a step is in flight (async scheduling, `advance`)."""
        out = SchedulerOutput()
        planned: dict[Request, tuple[list[int], int]] = {}
        if not lookahead:
            self.needs_sync = False
        budget, preempted = self._schedule_running(
            out, planned, self.max_num_batched_tokens, lookahead
        )
        # No admissions in a step that had to preempt: the pool is under pressure.
        if admit and not preempted:
            budget = self._admit_waiting(planned, budget)
        out.finished_ids, self._dropped = self._dropped, []
        for req, (new_ids, n) in planned.items():
            if req.sent_to_compute:
                out.continuing.append(ContinuingScheduled(req, new_ids, n))
            else:
                ids = self.block_manager.block_ids(req.request_id)
                out.new.append(NewScheduled(req, ids, req.num_computed_tokens, n))
                req.sent_to_compute = True
        out.num_tokens = self.max_num_batched_tokens - budget
        return out

    def _schedule_running(
        self,
        out: SchedulerOutput,
        planned: dict[Request, tuple[list[int], int]],
        budget: int,
        lookahead: bool = False,
    ) -> tuple[int, bool]:
        """Decodes first, then prefill chunks; preempt from the back when the pool is
        short (not in a lookahead step). Returns the budget left and whether anything
        was preempted."""
        preempted = False
        decodes: list[Request] = []
        prefills: list[Request] = []
        max_model_len = self.max_model_len
        for r in self.running:
            left = len(r.token_ids) - r.num_computed_tokens
            if r.num_pending and len(r.token_ids) >= min(r.max_num_tokens, max_model_len):
                continue  # its pending token is its last (max_tokens): nothing to plan
            if left == 1:
                decodes.append(r)
            elif left > 1:
                prefills.append(r)
        allocate = self.block_manager.allocate
        has_free_slot = self.block_manager.has_free_slot
        in_blocks = out.decodes
        running = Status.RUNNING
        spec = self.speculator
        if lookahead or (spec is not None and not spec.active(len(decodes))):
            spec = None
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            n = len(req.token_ids) - req.num_computed_tokens
            if n == 1 and spec is not None and req.sent_to_compute and req.grammar is None:
                proposal = self._speculate(spec, req, budget - 1)
                k = _num_proposed(proposal)
                if (
                    k
                    and self._spare_blocks(req, k)
                    and (new_ids := allocate(req, 1 + k)) is not None
                ):
                    planned[req] = (new_ids, 1)
                    out.proposals[req] = proposal
                    budget -= 1 + k
                    continue
            if n == 1 and req.sent_to_compute and has_free_slot(req):
                in_blocks.append(req)  # the next token's slot is in a block it holds
                budget -= 1
                continue
            n = min(n, budget)
            if lookahead:  # no preemption with a step in flight: the request waits
                if (new_ids := allocate(req, n)) is None:
                    self.needs_sync = True
                else:
                    planned[req] = (new_ids, n)
                    budget -= n
                continue
            while (new_ids := allocate(req, n)) is None:
                victim = self.running[-1]
                if victim in planned:
                    budget += planned.pop(victim)[1]
                    if (p := out.proposals.pop(victim, None)) is not None:
                        budget += _num_proposed(p)
                elif victim is not req and victim in in_blocks:
                    in_blocks.remove(victim)
                    budget += 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_ids is not None:
                planned[req] = (new_ids, n)
                budget -= n
        return budget, preempted

    def _spare_blocks(self, req: Request, k: int) -> bool:
        """Whether the pool can spare the blocks of k proposed positions: the blocks they
        need beyond the request's next token leave at least one per running request (so
        speculating does not make another request, or this one, be preempted)."""
        bm = self.block_manager
        extra = bm.blocks_needed(req, 1 + k) - bm.blocks_needed(req, 1)
        return extra == 0 or bm.num_free_blocks - extra >= len(self.running)

    def _speculate(self, spec: Speculator, req: Request, budget: int) -> list[int] | int:
        """What `req` proposes this step: tokens (ngram) or how many to draft."""
        tokens = req.token_ids
        # Its tokens after the step (accepted + 1) stay within max_tokens and max_model_len.
        limit = min(req.max_num_tokens, self.max_model_len) - len(tokens) - 1
        return spec.propose(req.request_id, tokens, min(limit, budget))

    def _admit_waiting(self, planned: dict[Request, tuple[list[int], int]], budget: int) -> int:
        """Start waiting requests in order while budget, blocks and max_num_seqs allow,
        and while the step's new requests stay within `max_step_new_bytes` on the link
        (the first always starts)."""
        bm = self.block_manager
        wire = 0  # (an upper bound of) the bytes of the requests started in this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            size = _wire_bytes(req, bm.block_size)  # (a waiting request is sent in full)
            if wire and wire + size > self.max_step_new_bytes:
                break
            forked = bm.holds_blocks(req.request_id)  # holds its parent's blocks
            prefix = [] if forked or req.skip_prefix_cache else bm.find_prefix(req)
            hit = req.num_computed_tokens if forked else len(prefix) * bm.block_size
            req.num_computed_tokens = hit
            n = min(req.num_tokens - hit, budget)
            new_ids = bm.allocate(req, n, prefix)
            if new_ids is None:
                req.num_computed_tokens = hit if forked else 0
                # With nothing running, no block is ever freed but those forked choices
                # hold while they wait behind this request (n > 1): give them back, or
                # the queue waits forever. The choices compute their prompt themselves
                # (a prefix-cache hit where it is still cached).
                if self.running or not self._unfork_waiting(req):
                    break
                continue
            self.waiting.popleft()
            wire += size
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
                # A request that skipped the lookup (prompt logprobs; caching off) is no
                # query of the cache: counted, its 0 hits would lower the hit rate (vLLM
                # counts it in neither). A re-admission after preemption is no new query
                # either (as vLLM's exported counters): it would mostly find its own blocks.
                if bm.pool.enable_caching and not req.skip_prefix_cache:
                    bm.record_prefix_lookup(req.num_prompt_tokens, hit)
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            planned[req] = (new_ids, n)
            budget -= n
        return budget

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        accepted: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Apply a step's result: advance progress, append sampled tokens, finish requests.

        `accepted`: speculative decoding's accepted proposals per request, which come before
        its sampled token. A request that a token of them ends keeps none after it: its
        lists in `accepted` and `sampled` are cut there (what the streams then get)."""
        finished = []
        cache_computed = self.block_manager.cache_computed
        release = self.block_manager.release_outside_window
        window = self.block_manager.window
        bs = self.block_manager.block_size
        forks = self.pending_forks
        running = Status.RUNNING
        max_model_len = self.max_model_len
        for req, n in out.scheduled():
            if req.status is not running:
                continue  # aborted while the step was in flight
            acc = accepted.get(req.request_id) if accepted else None
            if acc:  # the accepted proposals' K/V is computed too; they are its next tokens
                n += len(acc)
                if self._take_accepted(req, acc, sampled, accepted):  # type: ignore[arg-type]
                    finished.append(req)
                    continue
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            # One token fills a block only at a block boundary; cache_computed catches
            # up from where it last stopped, so skipping the calls in between loses nothing.
            if n > 1 or computed % bs == 0:
                cache_computed(req)
            if window:
                release(req)
            if (
                forks
                and req.request_id in forks
                and req.num_computed_tokens >= req.num_prompt_tokens
            ):
                self._fork_siblings(req)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            tokens = req.token_ids
            tokens.append(token)
            if (status := req.stop_check(token, max_model_len)) is not None:
                self.finish(req.request_id, status)
                finished.append(req)
        return finished

    def advance(self, out: SchedulerOutput) -> None:
        """Async scheduling: step `out` is sent and its result not back. Count its tokens
        as computed; each request that samples in it gets a PENDING_TOKEN (`resolve`
        writes the real one). Nothing is cached or ended here: the tokens are unknown."""
        running = Status.RUNNING
        for req, n in out.scheduled():
            if req.status is not running:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens == len(req.token_ids):  # it samples in this step
                req.token_ids.append(PENDING_TOKEN)
                req.num_pending += 1

    def resolve(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Async scheduling: the result of step `out` (which `advance` counted) arrived.
        Its sampled tokens replace the oldest placeholders; EOS, stop tokens, max_tokens
        and max_model_len end requests here, dropping what later steps sample for them.
        Full blocks of known tokens are indexed for the prefix cache; siblings fork.
        Returns the requests ended."""
        finished = []
        cache_computed = self.block_manager.cache_computed
        release = self.block_manager.release_outside_window
        window = self.block_manager.window
        forks = self.pending_forks
        running = Status.RUNNING
        max_model_len = self.max_model_len
        for req, _ in out.scheduled():
            rid = req.request_id
            if req.status is not running:
                sampled.pop(rid, None)  # ended while the step ran: its token is dropped
                continue
            token = sampled.get(rid)
            tokens = req.token_ids
            if token is not None:
                pending = req.num_pending
                # The oldest placeholder is this token's; the check sees the tokens up to it.
                del tokens[len(tokens) - pending :]
                tokens.append(token)
                req.num_pending = 0
                if (status := req.stop_check(token, max_model_len)) is not None:
                    cache_computed(req)  # its blocks stay in the prefix cache once freed
                    if forks and rid in forks:  # (its prompt is computed: it sampled)
                        self._fork_siblings(req)  # before its blocks are freed, as update
                    self.finish(rid, status)
                    finished.append(req)
                    continue
                tokens.extend([PENDING_TOKEN] * (pending - 1))
                req.num_pending = pending - 1
            # Blocks of known tokens are indexed (with two or more steps in flight, a
            # position counted as computed may still hold a placeholder: not those).
            cache_computed(req)
            if window:
                release(req)
            if forks and rid in forks and req.num_computed_tokens >= req.num_prompt_tokens:
                self._fork_siblings(req)
        return finished

    # ---------------------------------------------------------------- helpers
    def _take_accepted(
        self,
        req: Request,
        acc: list[int],
        sampled: dict[str, int],
        accepted: dict[str, list[int]],
    ) -> bool:
        """Append accepted proposals until one ends the request (True: then its lists are
        cut so that one is its last token)."""
        tokens, rid = req.token_ids, req.request_id
        for j, token in enumerate(acc):
            tokens.append(token)
            if (status := req.stop_check(token, self.max_model_len)) is not None:
                self.finish(rid, status)
                accepted[rid] = acc[:j]
                sampled[rid] = token
                return True
        return False

    def _unfork_waiting(self, head: Request) -> bool:
        """Free the blocks that waiting requests other than `head` hold (forked choices);
        whether there were any."""
        holders = [
            r
            for r in self.waiting
            if r is not head and self.block_manager.holds_blocks(r.request_id)
        ]
        for r in holders:
            self._release(r)
            r.num_computed_tokens = 0
        return bool(holders)

    def _fork_siblings(self, parent: Request) -> None:
        siblings = self.pending_forks.pop(parent.request_id)
        for child in siblings:
            self.block_manager.fork(parent, child)
        self.waiting.extendleft(reversed(siblings))

    def _preempt(self, req: Request) -> None:
        assert not req.num_pending, "preempting a request with a step in flight"
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        self.block_manager.free(req)
        if req.sent_to_compute:
            self._dropped.append(req.request_id)
            req.sent_to_compute = False
