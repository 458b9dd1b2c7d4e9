"""A request as the scheduler sees it: tokens, progress, limits, status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# Async scheduling: the token a request samples in a step still in flight. The compute
# plane holds the real one (it decodes it next without being told); the control plane
# writes it over this when the step's result arrives.
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_GRAMMAR = "grammar"  # structured output: no token can continue the grammar

    @property
    def finished(self) -> bool:
        return self not in (Status.WAITING, Status.RUNNING)


@dataclass(eq=False)
class Request:
    """Progress is arithmetic: `num_computed_tokens` of `num_tokens` have K/V in the cache.

    There is no prefill or decode state: a request with many uncomputed tokens is
    prefilling (maybe in chunks), one with exactly one is decoding. Preemption
    resets num_computed_tokens to 0 and keeps the generated tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: Any = None  # compute.proto SamplingParams, passed through to the compute plane
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    status: Status = Status.WAITING
    sent_to_compute: bool = False  # the compute plane holds its state (else send it in full)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    traceparent: str = ""  # the control plane's span of its stream, for the compute plane's
    grammar: Any = None  # control_plane.grammar.GrammarState of a constrained request
    skip_prefix_cache: bool = False  # compute the whole prompt (prompt logprobs)
    # Shares prefix-cache blocks only with requests of the same salt ("" with the unsalted):
    # the root of its block keys (block_pool.root_hash).
    cache_salt: str = ""
    # Generate nothing (GenerationParams.prompt_only): the token sampled when the prompt is
    # computed ends it, by length, and is dropped (max_tokens is 1 for that token).
    prompt_only: bool = False
    # Async scheduling: trailing PENDING_TOKENs in token_ids, one per step in flight that
    # samples for it (0 when nothing is in flight).
    num_pending: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # What can end it (stop_check):
        # the tokens that stop it, and its length at max_tokens.
        self.stop_ids = self.stop_token_ids | (
            frozenset() if self.ignore_eos else self.eos_token_ids
        )
        self.max_num_tokens = self.num_prompt_tokens + self.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def drop_pending(self) -> None:
        """Forget the tokens of steps in flight (the request ended or lost its compute plane)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    def drop_last(self, n: int) -> None:
        """Remove the last `n` known tokens (sampled after a stop string), not the pending."""
        end = len(self.token_ids) - self.num_pending
        del self.token_ids[end - n : end]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def stop_check(self, token: int, max_model_len: int) -> Status | None:
        """The finished status that appending `token` causes, if any (a prompt-only
        request's token is taken back: it ends it, by length)."""
        # The first min_tokens tokens may not end the request (vLLM's min_tokens).
        if self.prompt_only:
            self.drop_last(1)  # (appended by the caller: not output)
            return Status.FINISHED_LENGTH
        num_tokens = len(self.token_ids)
        num_output = num_tokens - self.num_prompt_tokens
        if num_output > self.min_tokens and token in self.stop_ids:
            self.stop_reason = token
            return Status.FINISHED_STOPPED
        if num_tokens >= self.max_num_tokens or num_tokens >= max_model_len:
            return Status.FINISHED_LENGTH
        return None
