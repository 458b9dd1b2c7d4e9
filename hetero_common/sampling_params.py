"""Sampling parameters as plain data, with the one validation both planes use (no torch)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hetero_common.limits import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MAX_TOP_LOGPROBS
from hetero_proto import compute_pb2 as pb

# Below this temperature a row is sampled greedily (vLLM's _SAMPLING_EPS): dividing the
# logits by a smaller one overflows float32 to inf, and the softmax of inf is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingSpec:
    """Torch-free mirror of compute.proto SamplingParams."""

    temperature: float = 0.0  # 0 (below GREEDY_BELOW_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    banned_until_min: tuple[int, ...] = ()  # EOS / stop ids masked before min_tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    prompt_logprobs: int | None = None  # score the prompt's tokens, with this many top ones

    @classmethod
    def from_proto(cls, p: pb.SamplingParams) -> SamplingSpec:
        """proto3 zero defaults mean "off": top_p 0 -> 1, repetition_penalty 0 -> 1."""
        return cls(
            temperature=p.temperature,
            top_p=p.top_p or 1.0,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed if p.HasField("seed") else None,
            repetition_penalty=p.repetition_penalty or 1.0,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            logprobs=p.logprobs,
            top_logprobs=p.top_logprobs,
            min_tokens=p.min_tokens,
            banned_until_min=tuple(p.min_tokens_banned_ids),
            logit_bias=tuple(sorted(p.logit_bias.items())),
            prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or bool(self.frequency_penalty)
            or bool(self.presence_penalty)
        )

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """The token is the logits' argmax and nothing else is asked (no penalty, bias,
        ban, logprobs): what most rows of a greedy benchmark are, checked once."""
        return (
            self.greedy
            and not self.penalised
            and not self.logit_bias
            and not (self.min_tokens and self.banned_until_min)
            and not self.logprobs
            and not self.top_logprobs
        )

    def validate(self, vocab_size: int | None = None) -> str | None:
        """A message naming the first bad field, or None; token ids must be below
        `vocab_size` when it is given."""
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # (NaN too)
            return f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
        if not (0.0 < self.top_p <= 1.0):
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0 (0 = off), got {self.top_k}"
        if not (0.0 <= self.min_p <= 1.0):
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:  # (NaN too)
            return (
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                return f"{name} must be in [-2, 2], got {v}"
        if self.min_tokens < 0:
            return f"min_tokens must be >= 0, got {self.min_tokens}"
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            return f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            return f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.prompt_logprobs}"
        for t, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                return f"logit_bias of token {t} must be in [-100, 100], got {bias}"
        if vocab_size is not None:
            bad = [t for t in self.banned_until_min if not 0 <= t < vocab_size]
            if bad:
                return f"token id {bad[0]} (min_tokens_banned_ids) not in 0..{vocab_size - 1}"
            bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                return (
                    f"logit_bias: token id {bad[0]} is not in 0..{vocab_size - 1} "
                    f"(the vocabulary has {vocab_size} tokens)"
                )
        return None
