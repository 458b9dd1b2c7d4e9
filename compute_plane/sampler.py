"""Sampling on the compute plane: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Seeded rows draw their randomness from a generator seeded by (seed, position), so a
request's tokens do not depend on which other requests share its batch, nor on
whether it was recomputed after a preemption.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from compute_plane.sampling_params import SamplingSpec


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of the sampled token, when any row asked
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def sample(
    logits: torch.Tensor,  # [B, V] float32
    specs: list[SamplingSpec],
    prompt_token_ids: list[list[int]],  # per row, for the repetition penalty
    output_token_ids: list[list[int]],  # per row, generated so far (all penalties)
    positions: list[int],  # per row, index of the token being sampled
    banned_ids: list[tuple[int, ...]] | None = None,  # per row, tokens that may not be sampled
) -> SampleOutput:
    """Pick one token per row. Logprobs are of the penalised distribution before temperature."""
    plain = all(
        s.greedy and not s.penalised and not s.logprobs and not s.top_logprobs for s in specs
    )
    if plain and not (banned_ids and any(banned_ids)):
        return SampleOutput(logits.argmax(dim=-1).tolist(), None, None, None)

    logits = logits.clone()
    for i, banned in enumerate(banned_ids or []):
        if banned:
            logits[i, list(banned)] = -math.inf
    for i, s in enumerate(specs):
        if s.penalised:
            _apply_penalties(logits[i], s, prompt_token_ids[i], output_token_ids[i])

    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(specs) if not s.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[idx], [specs[i] for i in random_rows])
        noise = torch.stack(
            [
                _exponential(probs.shape[1], specs[i].seed, positions[i], probs.device)
                for i in random_rows
            ]
        )
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        chosen[idx] = (probs / noise).argmax(dim=-1)

    out = SampleOutput(chosen.tolist(), None, None, None)
    want_lp = [s.logprobs or s.top_logprobs > 0 for s in specs]
    if any(want_lp):
        logp = torch.log_softmax(logits, dim=-1)
        out.logprobs = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
        k = max(s.top_logprobs for s in specs)
        if k:
            vals, ids = logp.topk(k, dim=-1)
            out.top_ids = ids.tolist()
            out.top_logprobs = vals.tolist()
    return out


def _apply_penalties(
    row: torch.Tensor, s: SamplingSpec, prompt: list[int], output: list[int]
) -> None:
    dev = row.device
    if s.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=dev)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty
            )
    if output and (s.frequency_penalty or s.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=dev), minlength=row.shape[0]).to(
            row.dtype
        )
        row -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(row.dtype)


def _filtered_probs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, vectorised over rows; returns probabilities."""
    dev = logits.device
    temps = torch.tensor([s.temperature for s in specs], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    vocab = logits.shape[1]
    top_k = torch.tensor([s.top_k or vocab for s in specs], device=dev)
    top_p = torch.tensor([s.top_p for s in specs], device=dev, dtype=logits.dtype)
    min_p = torch.tensor([s.min_p for s in specs], device=dev, dtype=logits.dtype)

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the
    # mass before it already reaches top_p. The first token is always kept.
    before = probs.cumsum(dim=-1) - probs
    drop = drop | (before >= top_p[:, None])
    drop = drop | (probs < min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    filtered = torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)


_UNSEEDED = torch.Generator()
_UNSEEDED.seed()


def _exponential(n: int, seed: int | None, position: int, device: torch.device) -> torch.Tensor:
    if seed is None:
        gen = _UNSEEDED
    else:
        digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.empty(n).exponential_(generator=gen).clamp_min_(1e-20).to(device)
