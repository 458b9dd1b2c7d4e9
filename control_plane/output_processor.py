"""Output processing: a step's sampled tokens become each stream's deltas (vLLM v1's
output processor): detokenise, find stop strings, pack or build responses, finish
streams. Runs while the next step computes (the engine's overlapped loop).

It owns the live streams and choices; the engine registers a stream at admission and
drops it on abort. Pure bookkeeping over plain objects: unit-testable without gRPC.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram

from control_plane import metrics
from control_plane.outputs import Choice, GenerateStream, Outbox
from control_plane.request import Status
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb


class StepMetrics(Protocol):
    """The labelled metric children a step observes (looked up once per label set)."""

    generation_tokens: PromCounter
    ttft: Histogram
    itl: Histogram


Touched = dict[str, tuple[GenerateStream, pb.GenerateResponse]]


class OutputProcessor:
    def __init__(
        self,
        stream_interval: int,
        finish: Callable[[str, Status], object],
        on_finished: Callable[[GenerateStream], None],
    ) -> None:
        """`finish(request_id, status)` ends a request in the scheduler (a stop string);
        `on_finished(stream)` observes a stream whose last choice ended."""
        self.stream_interval = stream_interval
        self._finish = finish
        self._on_finished = on_finished
        self.streams: dict[str, GenerateStream] = {}
        self.choices: dict[str, tuple[GenerateStream, Choice]] = {}

    def add(self, stream: GenerateStream) -> None:
        self.streams[stream.stream_id] = stream
        for c in stream.choices:
            self.choices[c.request.request_id] = (stream, c)

    def remove(self, stream: GenerateStream) -> bool:
        """Forget a stream (aborted); False when it was not live."""
        if self.streams.pop(stream.stream_id, None) is None:
            return False
        for c in stream.choices:
            self.choices.pop(c.request.request_id, None)
        return True

    @staticmethod
    def drop_held_back(stream: GenerateStream) -> int:
        """Drop the tokens a removed stream's unfinished choices hold back (--stream-interval)
        and return how many of them count as generated: those up to a stop string, which
        interval 1 would have sent (and counted) as they were sampled."""
        count = 0
        for c in stream.choices:
            if c.pending and not c.finished:
                count += stream.new_text(c, c.pending)[1]
                c.pending.clear()
                c.pending_logprobs.clear()
        return count

    def process(
        self,
        result: cpb.StepResult,
        sampled: dict[str, int],
        m: StepMetrics,
        accepted: dict[str, list[int]] | None = None,
    ) -> None:
        """Hand each stream its new tokens: every `stream_interval` tokens, and the first and
        last at once. Detokenising, stop strings and the response happen only then.
        `accepted`: speculative decoding's accepted proposals, before each sampled token."""
        touched: Touched = {}
        interval = self.stream_interval
        running, waiting = Status.RUNNING, Status.WAITING
        now = time.monotonic()
        # Tokens sent to streams: a stop string drops those sampled after it (accepted
        # proposals past it, or tokens held back by the interval), as if never sampled.
        emitted = 0
        gaps: list[float] = []  # inter-token latencies seen by this step's tokens
        logprobs = {r.request_id: r for r in result.results} if result.results else None
        several: dict[str, list[cpb.TokenResult]] = {}  # a verifying request's, in order
        if accepted and result.results:
            for r in result.results:
                several.setdefault(r.request_id, []).append(r)
        choices = self.choices
        for p in result.prompt_logprobs:
            if (entry := choices.get(p.request_id)) is not None:
                entry[1].add_prompt_logprobs(p)
        for rid, token in sampled.items():
            entry = choices.get(rid)
            if entry is None:
                continue  # aborted while the step ran
            stream, choice = entry
            if (last := choice.last_token_time) is not None:
                gaps.append(now - last)
            elif stream.first_token_time is None:  # the stream's first token (any choice)
                stream.first_token_time = now
                m.ttft.observe(now - stream.arrival_time)
            choice.last_token_time = now
            pending = choice.pending
            extra = accepted.get(rid) if accepted else None
            if extra:
                pending.extend(extra)
            pending.append(token)
            if rid in several:
                choice.pending_logprobs.extend(several[rid][: len(extra or ()) + 1])
            elif logprobs is not None and rid in logprobs:
                choice.pending_logprobs.append(logprobs[rid])
            req = choice.request
            # A request that got a token goes on unless this token finished it. It may be
            # waiting: preempted by the next step's plan, made before this process call.
            live = (status := req.status) is running or status is waiting
            if len(pending) < interval and live and choice.sent:
                continue
            first, choice.sent = not choice.sent, True
            box = stream.pack_into if live else None
            if first and not stream.num_cached_tokens and (hit := stream.prefix_hit) > 0:
                # The hit goes out from the stream's first delta on, whichever choice's
                # (in responses: a packed delta has no room for it), so streamed usage
                # can count it before the last message.
                stream.num_cached_tokens = hit
                box = None
            # The common case, packed; inlined rather than through new_text (a call per
            # token adds up at hundreds of sequences: benchmarks.overhead shows it).
            if box is not None and not choice.stop.stop:
                push = choice.detok.push
                text = push(token) if len(pending) == 1 else "".join(map(push, pending))
                box.delta(stream.client_id, pending, text)
                emitted += len(pending)
                pending.clear()
                continue
            emitted += self._respond(stream, choice, live, box, touched)
        m.generation_tokens.inc(emitted)
        for value, count in Counter(gaps).items():
            metrics.observe_many(m.itl, value, count)
        self._send(touched)

    def _respond(
        self,
        stream: GenerateStream,
        choice: Choice,
        live: bool,
        box: Outbox | None,
        touched: Touched,
    ) -> int:
        """The slow path: stop strings, logprobs, finishing, or an unpacked client (`box`:
        where a plain delta may go packed, else None). Returns how many tokens it sent."""
        pending, req = choice.pending, choice.request
        if req.prompt_only:  # its one sample ended it and is no output (Request.prompt_only)
            pending.clear()
            choice.pending_logprobs.clear()
        text, num_sent, matched = stream.new_text(choice, pending)
        if matched is None and box is not None:
            box.delta(stream.client_id, pending, text)
            pending.clear()
            return num_sent
        if (out := touched.get(stream.stream_id)) is None:
            out = touched[stream.stream_id] = (stream, stream.new_response())
        delta = stream.add_delta(choice, out[1], pending[:num_sent], text)
        pending.clear()
        choice.pending_logprobs.clear()
        if matched is not None:
            req.stop_reason = matched
            self._finish(req.request_id, Status.FINISHED_STOPPED)
            # Also when the scheduler ended it by length: the text ends at the stop string.
            req.status = Status.FINISHED_STOPPED
            live = False
        if not live:
            stream.finish(choice, delta, req.status)
            self.choices.pop(req.request_id, None)
        return num_sent

    def _send(self, touched: Touched) -> None:
        for stream, resp in touched.values():
            if stream.num_cached_tokens:
                resp.cached_prompt_tokens = stream.cached_prompt_tokens
            if ended := stream.done:
                self._on_finished(stream)
                resp.usage.CopyFrom(stream.usage())
                self.streams.pop(stream.stream_id, None)
            stream.send(resp, ended)
