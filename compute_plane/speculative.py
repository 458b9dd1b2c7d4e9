"""Speculative decoding on the compute plane: the draft model, and verifying proposals.

A request decoding with a proposal of k tokens computes its last known token and the k
proposed ones in one step (k + 1 query positions over the paged KV, as a prefill chunk),
and samples after each of them as it would have without the proposal (`verify`). The
proposals are deterministic (the control plane's n-gram lookup, or the draft model's
greedy tokens), so the standard rejection rule (accept x with probability
min(1, p(x) / q(x)), else draw from max(0, p - q) normalised) with a one-hot q is the
same as: draw the target's token at each position, accept while it equals the proposal,
and keep the first one that differs. Drawing with the same seed and position as a step
without speculation makes seeded (and greedy) output identical to it.

The draft model (any smaller model with the target's vocabulary) has its own KV cache
with the target's block ids: the control plane allocates blocks for the target, and the
draft's cache has a slot wherever the target's has one. `Drafter.computed` is how far
each request's draft KV is valid; a step catches it up from there (the prompt on the
first speculative step), then runs k - 1 one-token steps for the k greedy drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from compute_plane.kv_cache import KVCache
from compute_plane.model import Model
from compute_plane.model_runner import ModelRunner
from compute_plane.requests import RequestState, Row

log = logging.getLogger(__name__)

CATCH_UP = 8  # a catch-up of at most this many tokens runs as one-token queries (decode path)
CATCH_UP_CHUNK = 512  # a longer one runs in forwards of at most this many tokens


def accepted_length(sampled: list[int], proposed: list[int]) -> int:
    """How many proposed tokens the target's samples reproduce, from the first on."""
    a = 0
    for s, p in zip(sampled, proposed, strict=False):
        if s != p:
            break
        a += 1
    return a


@dataclass
class _Drafting:
    row: Row  # the target's row
    k: int  # tokens to draft
    view: RequestState  # the request's tokens as the draft sees them (+ its drafts)
    step: Row  # the draft's share of the next draft forward
    base: int  # known tokens before drafting


class Drafter:
    """A draft model, its KV cache, and how far each request's draft KV is valid."""

    def __init__(self, model: Model, kv_cache: KVCache, runner: ModelRunner, name: str) -> None:
        self.model, self.kv_cache, self.runner, self.name = model, kv_cache, runner, name
        self.computed: dict[str, int] = {}  # request id -> positions with valid draft KV

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.runner.release(request_id)

    def reset(self) -> None:
        self.computed.clear()
        self.runner.release_all()

    @torch.inference_mode()
    def propose(self, rows: list[tuple[Row, int]]) -> None:
        """Set each row's `draft` to k greedy tokens of the draft model after its known ones."""
        work: list[_Drafting] = []
        for r, k in rows:
            st = r.state
            tokens = list(st.token_ids)
            n = len(tokens)
            start = min(self.computed.get(r.request_id, 0), n - 1)
            view = RequestState(tokens, st.num_prompt_tokens, start, st.block_ids, st.sampling)
            step = Row(r.request_id, view, start, n - start, as_decodes=n - start <= CATCH_UP)
            work.append(_Drafting(r, k, view, step, n))
        for w in work:  # a long catch-up (the prompt, at first) in chunks, sampling nothing
            while w.step.count > CATCH_UP_CHUNK:
                rid, first = w.step.request_id, w.step.start
                x = self.runner.prepare([Row(rid, w.view, first, CATCH_UP_CHUNK)])
                self.model.forward(x.input_ids, x.positions, x.meta, self.kv_cache.layers)
                rest = w.step.count - CATCH_UP_CHUNK
                w.step = Row(rid, w.view, first + CATCH_UP_CHUNK, rest, as_decodes=rest <= CATCH_UP)
        active = work
        while active:
            # The runner wants decodes first (a short catch-up runs as decodes too).
            active.sort(key=lambda w: not (w.step.count == 1 or w.step.as_decodes))
            x = self.runner.prepare([w.step for w in active])
            hidden = self.model.forward(x.input_ids, x.positions, x.meta, self.kv_cache.layers)
            tokens = self.model.logits(hidden[x.sample_index]).argmax(dim=-1).tolist()
            left = []
            for w, t in zip(active, tokens, strict=True):
                w.view.token_ids.append(t)
                if len(w.view.token_ids) - w.base < w.k:
                    n = len(w.view.token_ids)
                    w.step = Row(w.row.request_id, w.view, n - 1, 1)
                    left.append(w)
            active = left
        for w in work:
            w.row.draft = w.view.token_ids[w.base :]
            # Valid after this step at most: the known tokens and the drafts fed back.
            self.computed[w.row.request_id] = w.base + w.k - 1

    def verified(self, request_id: str, base: int, accepted: int) -> None:
        """A step accepted `accepted` drafts after `base` known tokens: the draft KV is valid
        up to the last accepted one it was fed."""
        if request_id in self.computed:
            self.computed[request_id] = min(self.computed[request_id], base + accepted)
