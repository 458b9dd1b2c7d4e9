"""The compute plane's view of requests: their state between steps, and the checks a
step passes before anything changes. A new request with bad fields fails alone; a step
whose shape is wrong (unknown or repeated ids, too many tokens) is rejected whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hetero_common.sampling_params import SamplingSpec
from hetero_common.tracing import NO_SPAN, RequestSpan
from hetero_proto import compute_pb2 as pb


class StepRejected(Exception):
    """A step the engine will not run; `code` is a gRPC status code name."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingSpec
    span: RequestSpan = NO_SPAN  # its trace span here, when tracing (hetero_common.tracing)


@dataclass(slots=True)
class Row:
    """One request's share of a step."""

    request_id: str
    state: RequestState
    start: int  # first position computed this step
    count: int  # tokens computed this step
    mask: pb.TokenMask | None = None  # the tokens it may sample (structured output)
    # Speculative decoding: the proposed tokens this step verifies after its last known
    # token (appended to state.token_ids while the step runs; `count` includes them).
    draft: list[int] | None = None
    # Its tokens go to attention as one-token queries (a few tokens of a request whose
    # earlier ones are cached: the draft model's catch-up), sampling after the last.
    as_decodes: bool = False

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.state.token_ids)


Planned = tuple[str, RequestState, int]  # (id, state, tokens this step)


@dataclass(frozen=True)
class Failure:
    """A request the step fails alone; the compute plane does not hold it."""

    request_id: str
    code: str  # gRPC status code name
    message: str


@dataclass(frozen=True)
class StepLimits:
    num_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    max_step_tokens: int | None  # CUDA: the activation peak the KV pool was sized for
    max_speculative_tokens: int = 0  # most proposed tokens one request may verify in a step
    has_draft: bool = False  # a draft model is loaded (Proposal.num_draft_tokens allowed)


class StepValidator:
    """Checks a whole step against the requests this plane holds; changes nothing."""

    def __init__(self, limits: StepLimits) -> None:
        self.limits = limits

    def validate(
        self,
        req: pb.StepRequest,
        active: dict[str, RequestState],
        failed_before: Mapping[str, Failure] | None = None,
    ) -> tuple[list[Planned], list[Failure]]:
        """(id, state, num tokens) per scheduled request, and the new requests whose fields
        are bad (they fail alone); StepRejected naming the first fault of the step's shape.

        `failed_before`: requests failed alone in an earlier step that the control plane
        has not released yet. A step planned before it knew (async scheduling) may still
        schedule one: it fails again (in the failures) instead of rejecting the step."""
        finished = set(req.finished_ids)
        seen: set[str] = set()

        def once(rid: str) -> None:
            if rid in seen:
                raise StepRejected(f"request {rid!r} appears twice in step {req.step_id}")
            seen.add(rid)

        rows: list[Planned] = []
        failures: list[Failure] = []

        def held(rid: str) -> RequestState | None:
            once(rid)
            if rid in active and rid not in finished:
                return active[rid]
            if failed_before and rid in failed_before and rid not in finished:
                failures.append(failed_before[rid])
                return None
            raise StepRejected(f"unknown request id {rid!r} (not active on this compute plane)")

        num_blocks: dict[str, int] = {}  # the page table's length once this step's ids land
        for n in req.new_requests:
            once(n.request_id)
            if n.request_id in active and n.request_id not in finished:
                raise StepRejected(
                    f"request {n.request_id!r} is already active; send it as continuing"
                )
            try:
                rows.append(self._new(n))
                num_blocks[n.request_id] = len(n.block_ids)
            except StepRejected as e:
                failures.append(Failure(n.request_id, e.code, str(e)))
        for c in req.continuing:
            if (state := held(c.request_id)) is None:
                continue
            self._check_blocks(c.request_id, list(c.new_block_ids))
            nb = num_blocks[c.request_id] = len(state.block_ids) + len(c.new_block_ids)
            self._check_count(c.request_id, state, nb, c.num_scheduled_tokens)
            rows.append((c.request_id, state, c.num_scheduled_tokens))
        bs = self.limits.block_size
        for rid in req.decode_ids:  # most of a step: the common case without calls
            if rid not in seen and rid not in finished and (state := active.get(rid)):
                seen.add(rid)
            elif (state := held(rid)) is None:
                continue
            nb = len(state.block_ids)
            end = state.num_computed_tokens + 1
            if end > len(state.token_ids) or end > nb * bs:
                self._check_count(rid, state, nb, 1)  # raises, naming the fault
            num_blocks[rid] = nb
            rows.append((rid, state, 1))
        if req.masks:
            rows = self._check_masks(req, rows, failures)
        proposed = 0
        if req.proposals:
            rows, proposed = self._check_proposals(req, rows, failures, num_blocks)
        total, most = sum(n for _, _, n in rows) + proposed, self.limits.max_step_tokens
        if most is not None and total > most:
            raise StepRejected(
                f"step of {total} tokens exceeds max_num_batched_tokens "
                f"{most} (the activation peak the KV pool was sized for)",
                "RESOURCE_EXHAUSTED",
            )
        return rows, failures

    def _check_masks(
        self, req: pb.StepRequest, rows: list[Planned], failures: list[Failure]
    ) -> list[Planned]:
        """A mask names a request of this step, once (else the step is rejected); a mask
        whose content is bad fails its request alone."""
        planned = {rid for rid, _, _ in rows} | {f.request_id for f in failures}
        bad: set[str] = set()
        seen: set[str] = set()
        for m in req.masks:
            rid = m.request_id
            if rid not in planned or rid in seen:
                what = "twice" if rid in seen else "for a request not in this step"
                raise StepRejected(f"token mask {what}: {rid!r}")
            seen.add(rid)
            if problem := mask_problem(m, self.limits.vocab_size):
                bad.add(rid)
                failures.append(Failure(rid, "INVALID_ARGUMENT", f"request {rid!r}: {problem}"))
        return [r for r in rows if r[0] not in bad] if bad else rows

    def _check_proposals(
        self,
        req: pb.StepRequest,
        rows: list[Planned],
        failures: list[Failure],
        num_blocks: dict[str, int],
    ) -> tuple[list[Planned], int]:
        """A proposal names a decoding request of this step, once (else the step is
        rejected); one whose content is bad fails its request alone. Returns the rows left
        and the number of proposed tokens the step verifies."""
        lim = self.limits
        planned = {rid: (st, n) for rid, st, n in rows}
        failed = {f.request_id for f in failures}
        masked = {m.request_id for m in req.masks}
        bad: set[str] = set()
        seen: set[str] = set()
        total = 0
        for p in req.proposals:
            rid = p.request_id
            if rid in seen or (rid not in planned and rid not in failed):
                what = "twice" if rid in seen else "for a request not in this step"
                raise StepRejected(f"proposal {what}: {rid!r}")
            seen.add(rid)
            if rid in failed:
                continue
            state, n = planned[rid]
            k = len(p.token_ids) or p.num_draft_tokens
            end = state.num_computed_tokens + 1 + k
            problem = None
            if p.token_ids and p.num_draft_tokens:
                problem = "a proposal has token_ids or num_draft_tokens, not both"
            elif k < 1:
                problem = "a proposal proposes no token"
            elif k > lim.max_speculative_tokens:
                problem = (
                    f"{k} proposed tokens exceed this compute plane's "
                    f"max_speculative_tokens {lim.max_speculative_tokens}"
                )
            elif p.num_draft_tokens and not lim.has_draft:
                problem = "num_draft_tokens but this compute plane holds no draft model"
            elif n != 1 or state.num_computed_tokens + 1 != len(state.token_ids):
                problem = "a proposal needs a decoding request (its last known token only)"
            elif rid in masked:
                problem = "a proposal and a token mask in one step"
            elif p.token_ids and (min(p.token_ids) < 0 or max(p.token_ids) >= lim.vocab_size):
                problem = f"proposed token id out of range 0..{lim.vocab_size - 1}"
            elif end > lim.max_model_len:
                problem = (
                    f"{end} positions with the proposals exceed max_model_len {lim.max_model_len}"
                )
            elif end > num_blocks[rid] * lim.block_size:
                problem = (
                    f"{end} positions with the proposals do not fit in "
                    f"{num_blocks[rid]} blocks of {lim.block_size}"
                )
            if problem is not None:
                bad.add(rid)
                failures.append(Failure(rid, "INVALID_ARGUMENT", f"request {rid!r}: {problem}"))
            else:
                total += k
        return ([r for r in rows if r[0] not in bad] if bad else rows), total

    def _new(self, n: pb.NewRequest) -> Planned:
        rid, lim = n.request_id, self.limits
        tokens = list(n.token_ids)
        if not tokens:
            raise StepRejected(f"request {rid!r}: no token ids")
        if min(tokens) < 0 or max(tokens) >= lim.vocab_size:
            raise StepRejected(f"request {rid!r}: token id out of range 0..{lim.vocab_size - 1}")
        if len(tokens) > lim.max_model_len:
            raise StepRejected(
                f"request {rid!r}: {len(tokens)} tokens exceed max_model_len {lim.max_model_len}"
            )
        if not 0 <= n.num_prompt_tokens <= len(tokens):
            raise StepRejected(
                f"request {rid!r}: num_prompt_tokens {n.num_prompt_tokens} not in 0..{len(tokens)}"
            )
        if n.num_computed_tokens < 0:
            raise StepRejected(f"request {rid!r}: negative num_computed_tokens")
        blocks = list(n.block_ids)
        self._check_blocks(rid, blocks)
        spec = SamplingSpec.from_proto(n.sampling)
        if problem := spec.validate(lim.vocab_size):
            raise StepRejected(f"request {rid!r}: {problem}")
        state = RequestState(tokens, n.num_prompt_tokens, n.num_computed_tokens, blocks, spec)
        self._check_count(rid, state, len(blocks), n.num_scheduled_tokens)
        return rid, state, n.num_scheduled_tokens

    def _check_blocks(self, rid: str, blocks: list[int]) -> None:
        nb = self.limits.num_blocks
        if blocks and (min(blocks) < 1 or max(blocks) >= nb):
            bad = next(b for b in blocks if not 1 <= b < nb)
            raise StepRejected(
                f"request {rid!r}: block id {bad} out of range (valid: 1..{nb - 1}; 0 is the null block)"
            )

    def _check_count(self, rid: str, state: RequestState, num_blocks: int, n: int) -> None:
        end, bs = state.num_computed_tokens + n, self.limits.block_size
        if n < 1:
            raise StepRejected(f"request {rid!r}: num_scheduled_tokens must be >= 1, got {n}")
        if end > len(state.token_ids):
            raise StepRejected(
                f"request {rid!r}: {n} tokens scheduled from position {state.num_computed_tokens} "
                f"but only {len(state.token_ids)} tokens are known"
            )
        if end > num_blocks * bs:
            raise StepRejected(
                f"request {rid!r}: {end} tokens do not fit in {num_blocks} blocks of {bs}"
            )


def mask_problem(m: pb.TokenMask, vocab_size: int) -> str | None:
    """What is wrong with a token mask, or None."""
    if not 1 <= m.size <= vocab_size:
        return f"token mask size {m.size} not in 1..{vocab_size}"
    if m.bitmask:
        if m.ids or m.invert:
            return "token mask: bitmask and ids are exclusive"
        if len(m.bitmask) != (m.size + 7) // 8:
            return f"token mask: bitmask of {len(m.bitmask)} bytes for {m.size} tokens"
        bits = np.unpackbits(np.frombuffer(m.bitmask, np.uint8), bitorder="little")
        if not bits[: m.size].any():
            return "token mask allows no token"
        return None
    ids = np.asarray(m.ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= m.size):
        return f"token mask: id out of range 0..{m.size - 1}"
    if not m.invert and not len(ids):
        return "token mask allows no token"
    if m.invert and len(np.unique(ids)) >= m.size:
        return "token mask allows no token"
    return None
