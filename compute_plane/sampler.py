"""Sampling on the compute plane: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Order, as in vLLM / HF: ban ids (min_tokens), apply penalties, then logit_bias, to the raw logits; greedy rows
take the argmax; the others divide by temperature, drop tokens outside top-k, then top-p, then
min-p, and draw with the exponential race argmax(p / E), E ~ Exp(1).

Seeded rows draw E from a generator seeded by hash(seed, position), so a request's tokens do
not depend on which other requests share its batch, on its row, or on whether it was recomputed
after a preemption. Unseeded rows share torch's default generator of the logits' device.

`sample_on_device` queues all of it behind the forward and returns `DeviceSamples`, whose
copy to the host is queued too: on CUDA nothing waits for the GPU until `to_host`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hetero_common.sampling_params import SamplingSpec
from hetero_proto import compute_pb2 as pb

__all__ = [
    "DeviceSamples",
    "HostCopy",
    "SampleOutput",
    "SamplingSpec",
    "allowed_tokens",
    "sample_on_device",
]


@dataclass
class SampleOutput:
    """One entry per row. The logprob lists are set when any row asked for them."""

    token_ids: list[int]
    logprobs: list[float] | None  # of the sampled token
    top_ids: list[list[int]] | None  # max top_logprobs over the rows, most likely first
    top_logprobs: list[list[float]] | None


@dataclass(eq=False)
class HostCopy:
    """Tensors on their way from the device to the host: copies queued behind the work
    that makes them (into pinned memory on CUDA), one event for them all. On the CPU the
    tensors themselves."""

    host: list[torch.Tensor | None]
    event: torch.cuda.Event | None = None

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor | None]) -> HostCopy:
        device = next((t.device for t in tensors if t is not None), None)
        if device is None or device.type == "cpu":
            return cls(list(tensors))
        cuda = device.type == "cuda"
        host = [
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
            for t in tensors
        ]
        for t, h in zip(tensors, host, strict=True):
            if t is not None and h is not None:
                h.copy_(t, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return cls(host, event)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def lists(self) -> list[Any]:
        """The tensors as (nested) lists, once copied."""
        self.wait()
        return [None if h is None else h.tolist() for h in self.host]


@dataclass(eq=False)
class DeviceSamples:
    """A step's samples on the device (as SampleOutput, tensors), and their host copies:
    queued by `copy_to_host`, waited for by `wait` / `to_host`."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B]
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]
    copy: HostCopy | None = None

    def copy_to_host(self) -> DeviceSamples:
        """Queue the copies behind everything queued."""
        self.copy = HostCopy.of((self.token_ids, self.logprobs, self.top_ids, self.top_logprobs))
        return self

    def ready(self) -> bool:
        return self.copy is None or self.copy.ready()

    def wait(self) -> None:
        if self.copy is not None:
            self.copy.wait()

    def to_host(self) -> SampleOutput:
        copy = self.copy or self.copy_to_host().copy
        assert copy is not None
        ids, lp, top_ids, top_lp = copy.lists()
        return SampleOutput(ids, lp, top_ids, top_lp)


def sample_on_device(
    logits: torch.Tensor,  # [B, V] float32, on the model's device
    specs: list[SamplingSpec],
    prompt_token_ids: list[list[int]],  # per row, for the repetition penalty
    output_token_ids: list[list[int]],  # per row, generated so far (all penalties)
    positions: list[int],  # per row, index of the token being sampled (seeds)
    banned_ids: list[tuple[int, ...]] | None = None,  # per row, ids that may not be sampled
    masks: list[pb.TokenMask | None] | None = None,  # per row, the ids it may sample (grammar)
) -> DeviceSamples:
    """Pick one token per row.

    A row's token mask (structured output) bans every token it does not allow before anything
    else, so greedy, sampling and logprobs all see the masked distribution.
    Logprobs are log_softmax of the penalised (and banned-masked) logits, before temperature and
    the top-k / top-p / min-p filters: the model's own view of the token, as vLLM's default.
    Rows with the same spec, history and position get the same token whatever the batch.
    """
    b = logits.shape[0]
    assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
    assert len(specs) == len(prompt_token_ids) == len(output_token_ids) == len(positions) == b, (
        "one spec, prompt, output and position per logits row"
    )
    banned = banned_ids or [()] * b
    wants_lp = any(s.logprobs or s.top_logprobs for s in specs)
    row_masks = [(i, m) for i, m in enumerate(masks or ()) if m is not None]
    masked = [i for i, _ in row_masks]
    if (
        not wants_lp
        and not masked
        and not any(banned)
        and all(s.greedy and not s.penalised and not s.logit_bias for s in specs)
    ):
        return DeviceSamples(logits.argmax(dim=-1))

    logits = logits.float().clone()
    if masked:
        allowed = torch.stack([allowed_tokens(m, logits.shape[1]) for _, m in row_masks])
        idx = to_device(masked, torch.long, logits.device)
        allowed = allowed.pin_memory() if logits.device.type == "cuda" else allowed
        logits[idx] = logits[idx].masked_fill(
            ~allowed.to(logits.device, non_blocking=True), -math.inf
        )
    for i, s in enumerate(specs):
        if banned[i]:
            _ban(logits[i], to_device(banned[i], torch.long, logits.device))
        if s.penalised:
            _apply_penalties(logits[i], s, prompt_token_ids[i], output_token_ids[i])
        if s.logit_bias:
            bias_ids = to_device([t for t, _ in s.logit_bias], torch.long, logits.device)
            bias = to_device([b for _, b in s.logit_bias], logits.dtype, logits.device)
            logits[i, bias_ids] += bias

    chosen = logits.argmax(dim=-1)
    rand = [i for i, s in enumerate(specs) if not s.greedy]
    if rand:
        idx = to_device(rand, torch.long, logits.device)
        probs = _filtered_probs(logits[idx], [specs[i] for i in rand])
        seeds = [specs[i].seed for i in rand]
        noise = _race_noise(probs.shape, seeds, [positions[i] for i in rand], probs.device)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        chosen[idx] = (probs / noise).argmax(dim=-1)

    out = DeviceSamples(chosen)
    if wants_lp:
        logp = torch.log_softmax(logits, dim=-1)
        out.logprobs = logp.gather(1, chosen[:, None]).squeeze(1)
        k = min(max(s.top_logprobs for s in specs), logp.shape[1])
        if k:
            out.top_logprobs, out.top_ids = logp.topk(k, dim=-1)
    return out


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of `values` on `device`. On CUDA through pinned memory, asynchronously:
    a copy from pageable memory would wait for every kernel queued before it (the forward),
    and sampling then could not be queued behind the forward."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def allowed_tokens(m: pb.TokenMask, vocab_size: int) -> torch.Tensor:
    """A token mask (compute.proto) as a bool vector over the model's vocabulary (CPU)."""
    out = torch.zeros(vocab_size, dtype=torch.bool)
    n = min(m.size, vocab_size)
    if m.bitmask:
        bits = np.unpackbits(np.frombuffer(m.bitmask, np.uint8), bitorder="little")[:n]
        out[:n] = torch.from_numpy(bits.astype(np.bool_))
    elif m.invert:
        out[:n] = True
        out[torch.tensor(list(m.ids), dtype=torch.long)] = False
    else:
        out[torch.tensor(list(m.ids), dtype=torch.long)] = True
    return out


def _ban(row: torch.Tensor, ids: torch.Tensor) -> None:
    """In place: -inf at `ids` (EOS and stop ids before min_tokens), unless that leaves the
    row nothing to sample (a grammar's mask allowing only those ids): then the mask wins,
    rather than an argmax over all -inf picking token 0. Decided on the device (no sync)."""
    banned = row.index_fill(0, ids, -math.inf)
    row.copy_(torch.where(banned.isfinite().any(), banned, row))


# Penalised logits are kept below this: far past any real logit, and still finite after
# the division by the smallest temperature that is not greedy (a repetition penalty near
# 0 divides a positive logit by it, and inf makes the softmax NaN).
_MAX_PENALISED = 1e30


def _apply_penalties(
    row: torch.Tensor, s: SamplingSpec, prompt: list[int], output: list[int]
) -> None:
    """In place on one row: HF repetition penalty over prompt+output, OpenAI frequency/presence."""
    dev = row.device
    if s.repetition_penalty != 1.0:
        seen = to_device(sorted({*prompt, *output}), torch.long, dev)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty
            )
    if output and (s.frequency_penalty or s.presence_penalty):
        ids = to_device(output, torch.long, dev)
        # (not bincount: on CUDA it reads the largest id back, waiting for the forward)
        counts = torch.zeros_like(row).index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
        row -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(row.dtype)
    row.clamp_(max=_MAX_PENALISED)  # (-inf stays: banned and masked ids)


def _filtered_probs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, vectorised over rows with one sort (none
    when no row cuts, a top-k selection when rows cut by top-k alone)."""
    dev, dt = logits.device, logits.dtype
    logits = logits / to_device([s.temperature for s in specs], dt, dev)[:, None]
    if all(s.top_k == 0 and s.top_p >= 1.0 and s.min_p == 0.0 for s in specs):
        return logits.softmax(dim=-1)  # nothing to cut: skip the sort
    vocab = logits.shape[1]
    top_k = to_device([s.top_k or vocab for s in specs], torch.long, dev)
    k_max = max(s.top_k or vocab for s in specs)
    if k_max < vocab and all(s.top_p >= 1.0 and s.min_p == 0.0 for s in specs):
        # top-k alone needs the k largest, not the whole vocabulary in order.
        vals, ids = logits.topk(k_max, dim=-1)
        vals = vals.masked_fill(
            torch.arange(k_max, device=dev)[None, :] >= top_k[:, None], -math.inf
        )
        return torch.full_like(logits, -math.inf).scatter(1, ids, vals).softmax(dim=-1)
    # top_p 1 means off: with it the float cumsum could cut a far tail that rounds to 1.
    top_p = to_device([s.top_p if s.top_p < 1.0 else 2.0 for s in specs], dt, dev)
    min_p = to_device([s.min_p for s in specs], dt, dev)

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.arange(vocab, device=dev)[None, :] >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass
    # before it already reaches top_p. min-p compares with the top token's probability.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    kept = sorted_logits.masked_fill(drop, -math.inf)
    return torch.full_like(logits, -math.inf).scatter(1, order, kept).softmax(dim=-1)


def _race_noise(
    shape: torch.Size, seeds: list[int | None], positions: list[int], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise per row: unseeded rows in one call on the device, seeded rows on the CPU
    (so a seed gives the same tokens on every device), moved over together."""
    noise = torch.empty(shape, device=device).exponential_()
    seeded = [(r, seed) for r, seed in enumerate(seeds) if seed is not None]
    if seeded:
        rows = torch.empty(len(seeded), shape[1], pin_memory=device.type == "cuda")
        for j, (r, seed) in enumerate(seeded):
            rows[j].exponential_(generator=_generator(seed, positions[r]))
        at = to_device([r for r, _ in seeded], torch.long, device)
        noise[at] = rows.to(device, non_blocking=True)
    # Exponential draws may round to 0; p / 0 would be inf or nan and win the race.
    return noise.clamp_min_(1e-20)


def _generator(seed: int, position: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)  # 63 bits
