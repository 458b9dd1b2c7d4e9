"""Speculative decoding in the control plane: what each decoding request proposes per step.

Two proposers (`--speculative`):
  * ngram: prompt lookup. The last n tokens (n from ngram_max down to ngram_min) are looked
    up earlier in the request's prompt and output; the k tokens that followed the latest
    earlier occurrence are proposed. Costs no model (a scan of the request's tokens when
    the step is planned), and pays where the answer repeats the input (summaries, edits,
    extraction).
  * draft: the compute plane's draft model proposes k tokens (Proposal.num_draft_tokens).

The compute plane verifies the proposals in the request's decode step (compute.proto
Proposal) and returns the accepted ones; output is that of decoding without speculation.

Adaptivity: speculation costs compute on tokens that may be rejected, which a busy batch
pays for and a lone request does not. A step speculates only while at most `max_batch`
requests decode; each request's k follows its recent acceptance (a running mean of its
accepted tokens per verification + 1, up to k), and a request whose proposals keep failing
stops proposing for a while (doubling pauses), then tries one token again.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # ngram | draft
    num_tokens: int = 4  # most proposed tokens per request per step (k)
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 8  # speculate only while at most this many requests decode
    adaptive: bool = True  # k per request follows its acceptance

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in 1..64, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.max_batch}")


def ngram_propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens`
    (n_max down to n_min tokens long) that recurs: the latest occurrence followed by k
    tokens, else the one followed by the most (one that overlaps the suffix is cut short
    by the end of `tokens`); [] when none recurs.

    The search runs over the tokens' bytes (4 per token) with bytes.rfind, in C: a few
    microseconds per thousand tokens where a Python loop takes milliseconds."""
    size = len(tokens)
    if size < 2:
        return []
    data = array("i", tokens).tobytes()
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = data[(size - n) * 4 :]
        best: list[int] = []
        end = (size - 1) * 4  # an occurrence starts before the suffix itself
        while (at := data.rfind(pattern, 0, end)) >= 0:
            end = at + len(pattern) - 1  # next: occurrences that start before this one
            if at % 4:
                continue  # straddles two tokens
            i = at // 4
            follow = tokens[i + n : i + n + k]
            if len(follow) == k:
                return follow
            if len(follow) > len(best):
                best = follow
        if best:
            return best
    return []


@dataclass
class RequestSpeculation:
    """A request's recent acceptance, for its next k."""

    mean_accepted: float  # running mean of accepted tokens per verification
    paused: int = 0  # steps left without proposals
    pause: int = 1  # the next pause's length (doubles while proposals keep failing)


class Speculator:
    """Proposals for the decoding requests of a step (the scheduler asks per request)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.state: dict[str, RequestSpeculation] = {}
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # totals

    def active(self, num_decoding: int) -> bool:
        """Whether this step speculates at all."""
        return num_decoding <= self.config.max_batch

    def num_tokens(self, request_id: str) -> int:
        """This request's k this step (0: no proposal)."""
        cfg = self.config
        if not cfg.adaptive:
            return cfg.num_tokens
        st = self.state.get(request_id)
        if st is None:
            return cfg.num_tokens
        if st.paused:
            st.paused -= 1
            return 0
        return max(1, min(cfg.num_tokens, int(st.mean_accepted) + 1))

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int] | int:
        """ngram: the proposed tokens ([] for none); draft: how many to draft (0: none).
        `limit`: the most the request may take (its length limits)."""
        k = min(self.num_tokens(request_id), limit)
        if k <= 0:
            return [] if self.config.method == "ngram" else 0
        if self.config.method == "draft":
            return k
        return ngram_propose(tokens, k, self.config.ngram_min, self.config.ngram_max)

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification's outcome, for the request's next k."""
        st = self.state.get(request_id)
        if st is None:
            st = self.state[request_id] = RequestSpeculation(float(self.config.num_tokens))
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        st.mean_accepted = 0.7 * st.mean_accepted + 0.3 * accepted
        if st.mean_accepted < 0.3:  # proposals keep failing: stop for a while
            st.paused, st.pause = st.pause, min(st.pause * 2, 64)
            st.mean_accepted = 1.0  # then try again with k = 2 at most
        elif accepted:
            st.pause = 1

    def forget(self, request_id: str) -> None:
        self.state.pop(request_id, None)
