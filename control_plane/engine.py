"""The control plane's engine: admits requests, runs the step loop, streams outputs.

One asyncio task drives the attached compute plane: schedule -> send the step ->
push the previous step's deltas to their streams while it runs -> await its result ->
update the scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable

from control_plane import metrics
from control_plane.compute_client import (
    ComputeClient,
    ComputeLink,
    ComputeLinkError,
    StepFailed,
    sampled_tokens,
)
from control_plane.config import ControlConfig
from control_plane.grammar import Grammars
from control_plane.input_processor import InputProcessor, ModelBounds
from control_plane.output_processor import OutputProcessor
from control_plane.outputs import Choice, GenerateStream, Outbox
from control_plane.request import Request, Status
from control_plane.scheduler import AdmissionError, QueueFullError, Scheduler, SchedulerOutput
from control_plane.speculative import Speculator
from control_plane.tokenizer import TokenizerWrapper
from hetero_common.logs import valid_request_id
from hetero_common.tracing import start_span
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb

log = logging.getLogger(__name__)


class ComputeUnavailable(RuntimeError):
    """No compute plane is attached."""


class RequestFailed(RuntimeError):
    """One request failed (the compute plane refused it or it raised there, or it was in
    flight each time the compute plane failed twice in a row); the others go on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # gRPC status code name


# A request in flight this many times in a row when the compute plane failed is failed,
# not re-admitted: a request that crashes every compute plane must not crash them all.
MAX_COMPUTE_FAILURES = 2


class _LoopMetrics:
    """The labelled children of the metrics the step loop observes, looked up once.

    `labels()` costs a lock and a dict lookup; at 256 running sequences the step loop
    would pay it 500 times a step.
    """

    def __init__(self, labels: dict[str, str]) -> None:
        self.generation_tokens = metrics.generation_tokens.labels(**labels)
        self.steps = metrics.steps.labels(planned_ahead="false", **labels)
        self.steps_ahead = metrics.steps.labels(planned_ahead="true", **labels)
        self.ttft = metrics.ttft.labels(**labels)
        self.itl = metrics.itl.labels(**labels)
        self.running = metrics.requests_running.labels(**labels)
        self.waiting = metrics.requests_waiting.labels(**labels)
        self.kv_usage = metrics.kv_cache_usage.labels(**labels)
        self.spec_drafts = metrics.spec_drafts.labels(**labels)
        self.spec_draft_tokens = metrics.spec_draft_tokens.labels(**labels)
        self.spec_accepted = metrics.spec_accepted_tokens.labels(**labels)
        self.spec_emitted = metrics.spec_emitted_tokens.labels(**labels)
        self.labels = labels


def _queue(sched: Scheduler, stream: GenerateStream) -> None:
    """Queue a stream's choices (the others fork the first's prompt blocks): all or none."""
    added: list[Request] = []
    try:
        first = stream.choices[0].request
        for c in stream.choices:
            sched.add_request(c.request, fork_of=None if c.request is first else first)
            added.append(c.request)
    except Exception:
        for r in added:
            sched.abort(r.request_id)
        raise


class ControlEngine:
    def __init__(
        self,
        config: ControlConfig,
        tokenizer: TokenizerWrapper,
        link: ComputeLink | None = None,
        model_name: str = "unknown",
    ) -> None:
        """`model_name`: the served model's id (ModelInfo's), the metrics' model_name label."""
        self.config = config
        self.tokenizer = tokenizer
        self.grammars = Grammars(tokenizer)
        self.inputs = InputProcessor(tokenizer, self.grammars)
        self.client: ComputeLink = link or ComputeClient(config.compute, config.compute_tls)
        self.scheduler: Scheduler | None = None
        self.description: cpb.DescribeResponse | None = None
        self.outputs = OutputProcessor(
            config.stream_interval, self._finish_request, self._observe_finished
        )
        # The live streams and choices (the output processor's, shared).
        self.streams: dict[str, GenerateStream] = self.outputs.streams
        self.choices: dict[str, tuple[GenerateStream, Choice]] = self.outputs.choices
        self._wake = asyncio.Event()
        self._step_id = 0
        self._task: asyncio.Task[None] | None = None
        self.attached = asyncio.Event()
        self._set_model_label(model_name)
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        self._lost = False  # set by the watchdog when the compute plane stops answering
        self._lost_since = 0.0
        self._compute_draining = False  # the compute plane said so: start nothing new on it
        self.draining = False  # this process is shutting down: refuse new requests
        # Requests kept across a compute-plane failure, in re-admission order, with the
        # request whose prompt blocks they fork (n > 1) or None.
        self._parked: list[tuple[Request, Request | None]] = []
        # The steps sent whose results are not back, oldest first: one, or two with async
        # scheduling (the next one planned while the compute plane runs the first).
        self._in_flight: deque[SchedulerOutput] = deque()
        # Requests in flight when the compute plane failed, until a step of theirs runs,
        # with how many failures in a row they saw. They go back one at a time: the others
        # wait in `_held` until the one on trial has run a step (or ended), so a request
        # that crashes the compute plane again is alone among the suspects when it does.
        self._suspects: dict[str, int] = {}
        self._held: list[tuple[Request, Request | None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        # benchmarks.profile sets a list: one record of wall-clock marks (ns) per step.
        self.timeline: list[dict[str, int]] | None = None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="control-step-loop")
        self._watchdog = asyncio.create_task(self._watch(), name="compute-watchdog")

    async def stop(self) -> None:
        for task in (self._task, self._watchdog):
            if task:
                task.cancel()
        await self.client.close()

    async def _attach(self) -> None:
        d = await self.client.attach()
        num_blocks = min(d.num_kv_blocks, self.config.max_num_blocks or d.num_kv_blocks)
        max_len = min(d.max_model_len, self.config.max_model_len or d.max_model_len)
        max_len = min(max_len, (num_blocks - 1) * d.block_size)
        self.scheduler = Scheduler(
            num_blocks=num_blocks,
            block_size=d.block_size,
            max_model_len=max_len,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_waiting=self.config.max_waiting,
            enable_prefix_caching=self.config.enable_prefix_caching,
            sliding_window=d.sliding_window or None,
            speculator=self._speculator(d),
        )
        self.description = d
        self.grammars.bind(d.vocab_size, self._bounds(self.scheduler).eos_token_ids)
        self._compute_draining = False
        self._readmit()
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        metrics.compute_attached.labels(**self.labels).set(1)
        self.attached.set()
        log.info(
            "attached compute plane %s: %s, %d blocks of %d, max_model_len %d",
            self.config.compute,
            d.model_name,
            num_blocks,
            d.block_size,
            max_len,
        )

    def _speculator(self, d: cpb.DescribeResponse) -> Speculator | None:
        """Speculative decoding as configured, where the compute plane can verify it."""
        spec = self.config.speculation
        if spec is None:
            return None
        if d.max_speculative_tokens < 1:
            log.error("speculative decoding is off: the compute plane verifies no proposals")
            return None
        if spec.method == "draft" and not d.draft_model:
            log.error(
                "speculative decoding is off: --speculative draft, but the compute plane at "
                "%s holds no draft model (start it with --draft-model)",
                self.config.compute,
            )
            return None
        if spec.num_tokens > d.max_speculative_tokens:
            log.warning(
                "num_speculative_tokens %d capped at the compute plane's max_speculative_tokens %d",
                spec.num_tokens,
                d.max_speculative_tokens,
            )
            spec = dataclasses.replace(spec, num_tokens=d.max_speculative_tokens)
        log.info(
            "speculative decoding: %s, k <= %d, while <= %d requests decode%s",
            spec.method,
            spec.num_tokens,
            spec.max_batch,
            f" (draft model {d.draft_model})" if spec.method == "draft" else "",
        )
        return Speculator(spec)

    def _bounds(self, sched: Scheduler) -> ModelBounds:
        d = self.description
        eos = set(self.tokenizer.eos_token_ids) | set(d.eos_token_ids if d else ())
        return ModelBounds(sched.max_model_len, d.vocab_size if d else 0, frozenset(eos))

    def _set_model_label(self, name: str) -> None:
        self.labels = {"model_name": name}
        self._loop_metrics = _LoopMetrics(self.labels)

    # --------------------------------------------------------------- intake
    def submit(
        self,
        prompt_ids: list[int],
        params: pb.GenerationParams,
        outbox: Outbox | None = None,
        client_id: str = "",
        packed: bool = False,
        request_id: str = "",
        traceparent: str = "",
    ) -> GenerateStream:
        """Admit a request (n choices). Raises AdmissionError / QueueFullError / ComputeUnavailable.

        `request_id` (the client's, e.g. the gateway's X-Request-Id) names the request in
        the logs of this plane and the compute plane: it is the stream's id when no
        running stream has it (choices are `<id>-<i>` toward the compute plane).
        `traceparent`: the caller's trace span, parent of this request's span here.

        Its responses go to the stream's queue, or with `outbox` into that GenerateMany
        call's next message under `client_id`; with `packed` (the client reads packed
        deltas) its plain deltas go packed when it has one choice and no logprobs.
        """
        sched = self.scheduler
        if self.draining:
            raise ComputeUnavailable("the control plane is shutting down")
        if sched is None or not self.attached.is_set():
            raise ComputeUnavailable("no compute plane is attached")
        bounds = self._bounds(sched)
        max_tokens = self.inputs.check(prompt_ids, params, bounds)
        sched.check_admission(len(prompt_ids), max_tokens)
        usable = valid_request_id(request_id) and request_id not in self.streams
        stream_id = request_id if usable else uuid.uuid4().hex
        stream = self.inputs.make_stream(
            stream_id,
            prompt_ids,
            params,
            bounds,
            max_tokens,
            outbox,
            client_id,
            self.labels["model_name"],
        )
        self._trace(stream, traceparent, max_tokens)
        _queue(sched, stream)
        plain = len(stream.choices) == 1 and not (
            params.logprobs or params.top_logprobs or params.HasField("prompt_logprobs")
        )
        if outbox is not None and packed and plain:
            stream.pack_into = outbox
        self.outputs.add(stream)
        log.info(
            "request admitted: %d prompt tokens, %d choices, max_tokens %d",
            *(len(prompt_ids), len(stream.choices), max_tokens),
            extra={"request_id": stream_id},
        )
        metrics.prompt_tokens.labels(**self.labels).inc(len(prompt_ids))
        # The first message says "admitted" at once, before any token: a gateway can then
        # send its HTTP head knowing the request was not refused.
        admitted = stream.new_response()
        admitted.prompt_token_ids.extend(prompt_ids)
        stream.send(admitted)
        self._wake.set()
        return stream

    @staticmethod
    def _trace(stream: GenerateStream, traceparent: str, max_tokens: int) -> None:
        """Start the stream's span; its choices carry it to the compute plane."""
        stream.span = span = start_span(
            "control.generate",
            traceparent,
            {
                "hetero.request_id": stream.stream_id,
                "gen_ai.usage.input_tokens": len(stream.prompt_token_ids),
                "gen_ai.request.max_tokens": max_tokens,
                "gen_ai.request.choice.count": len(stream.choices),
            },
        )
        for c in stream.choices:
            c.request.traceparent = span.traceparent

    def abort(self, stream: GenerateStream) -> None:
        """Cancel a stream's unfinished choices now; their blocks are freed at once."""
        if not self.outputs.remove(stream):
            return
        stream.span.set({"gen_ai.response.finish_reasons": "abort"})
        stream.span.end()
        reason = Status.FINISHED_ABORTED.value
        metrics.request_success.labels(finished_reason=reason, **self.labels).inc()
        if self._held and self.scheduler is not None:
            self._next_suspect()
        for c in stream.choices:
            if not c.finished and self.scheduler is not None:
                self.scheduler.abort(c.request.request_id)
        self._wake.set()

    # ------------------------------------------------------------ step loop
    async def _run(self) -> None:
        backoff = 0.2
        while True:
            try:
                if not self.attached.is_set():
                    await self._attach()
                    backoff = 0.2
                await self._loop()
            except asyncio.CancelledError:
                raise
            except (ComputeLinkError, StepFailed) as e:
                now = time.monotonic()
                self._quarantine()
                if self.attached.is_set():
                    log.error("compute plane lost: %s; requests wait for it to come back", e)
                    self.attached.clear()
                    metrics.compute_attached.labels(**self.labels).set(0)
                    self._park()
                    self._lost_since = now
                elif self._parked and now - self._lost_since > self.config.compute_timeout:
                    log.error(
                        "compute plane away for %.0f s: failing its requests",
                        now - self._lost_since,
                    )
                    self._fail_all(e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _watch(self, interval: float = 0.5) -> None:
        """Notice a dead compute plane while idle (a step in flight notices by itself)."""
        misses = 0
        while True:
            await asyncio.sleep(interval)
            if not self.attached.is_set():
                misses = 0
                continue
            alive = await self.client.alive(draining=self._compute_draining)
            misses = 0 if alive else misses + 1
            if misses >= 2:
                self._lost = True
                self._wake.set()

    async def _loop(self) -> None:
        """Schedule, send the step, and while it runs turn the previous step's tokens into
        responses (detokenising, stop strings): output processing overlaps the compute
        plane's step instead of delaying the next one, as in vLLM's async output
        processing. A stop string found there ends its request one step late: that
        step's token for it is dropped, never sent or counted.

        With async scheduling the next step is planned and sent before the result of the
        one in flight (Scheduler.advance / resolve): the compute plane finds it queued when
        it finishes a step, so it never waits for the control plane's round trip. EOS and
        max_tokens then also end a request a step late (that step's token is dropped).
        Steps that need the previous step's tokens (grammar masks, speculative proposals)
        are planned with nothing in flight."""
        sched = self.scheduler
        assert sched is not None
        in_flight = self._in_flight
        # Sampled (and accepted proposals), not yet emitted.
        ready: tuple[cpb.StepResult, dict[str, int], dict[str, list[int]] | None] | None = None
        marks: deque[tuple[int, int, int, int, int]] = deque()  # timeline, per step in flight
        while True:
            out = None
            t_sched = time.time_ns()
            lookahead = bool(in_flight)
            if not self._lost and sched.has_work and (not lookahead or self._may_look_ahead(sched)):
                out = sched.schedule(admit=not self._compute_draining, lookahead=lookahead)
                if out.empty:
                    out = None
            if out is None and not in_flight:
                if ready is not None:  # no step to overlap with: emit now, then look again
                    self._emit(*ready)
                    ready = None
                    continue
                if self._lost:
                    self._lost = False
                    raise ComputeLinkError("the compute plane stopped answering health checks")
                self._observe_pool()
                self._wake.clear()
                await self._wake.wait()
                continue
            t_scheduled = t_encoded = t_sent = 0
            if out is not None:
                self._step_id += 1
                t_scheduled = time.time_ns()
                step = self._to_step(out)
                t_encoded = time.time_ns()
                (self._loop_metrics.steps_ahead if lookahead else self._loop_metrics.steps).inc()
                in_flight.append(out)
                try:
                    await self.client.send(step)
                finally:
                    t_sent = time.time_ns()
                    if ready is not None:  # emitted even when the link fails: kept tokens
                        self._emit(*ready)
                        ready = None
                if self.config.async_scheduling:
                    sched.advance(out)
            if ready is not None:
                self._emit(*ready)
                ready = None
            t_emitted = time.time_ns()
            if out is not None:
                marks.append((t_sched, t_scheduled, t_encoded, t_sent, t_emitted))
                if len(in_flight) == 1 and self._may_look_ahead(sched):
                    continue  # plan the next step while this one runs
            result = await self.client.receive()
            t_result = time.time_ns()
            done = in_flight.popleft()
            if self._suspects:
                self._clear_suspects(done)
            if result.failed:
                self._fail_requests(result.failed)
            if result.draining and not self._compute_draining:
                log.info("the compute plane is draining: new requests wait for the next one")
                self._compute_draining = True
            sampled = sampled_tokens(result)
            accepted = None
            if self.config.async_scheduling:
                sched.resolve(done, sampled)
            else:
                accepted = self._accepted(sched, result) if result.accepted else None
                sched.update(done, sampled, accepted)
            if self._constrained:
                self._advance_grammars(sched, sampled)
            ready = result, sampled, accepted
            self._observe_pool()
            if self.timeline is not None and marks:
                t0, t1, t2, t3, t4 = marks.popleft()
                self.timeline.append(
                    {
                        "step_id": result.step_id,
                        "num_seqs": result.num_seqs,
                        "num_tokens": result.num_tokens,
                        "schedule_start": t0,
                        "scheduled": t1,
                        "encoded": t2,
                        "sent": t3,
                        "emitted": t4,  # the previous step's outputs, while this runs
                        "result": t_result,
                        "updated": time.time_ns(),
                        "compute_received": result.received_unix_ns,
                        "compute_replied": result.replied_unix_ns,
                        "prepare_ns": result.prepare_ns,
                        "forward_ns": result.forward_ns,
                        "sample_ns": result.sample_ns,
                    }
                )

    def _may_look_ahead(self, sched: Scheduler) -> bool:
        """Whether the next step may be planned before the result of the one in flight:
        async scheduling is on, no lookahead step left a request short of blocks, and no
        request needs the tokens in flight to be planned (grammar masks, proposals)."""
        return (
            self.config.async_scheduling
            and not sched.needs_sync
            and sched.speculator is None
            and not self._constrained
        )

    def _accepted(self, sched: Scheduler, result: cpb.StepResult) -> dict[str, list[int]]:
        """Each verifying request's accepted proposals; the speculator and metrics see them."""
        accepted: dict[str, list[int]] = {}
        spec = sched.speculator
        lm = self._loop_metrics
        drafts = proposed = taken = 0
        per_pos: dict[int, int] = {}
        live = sched.requests
        for a in result.accepted:
            acc = accepted[a.request_id] = list(a.token_ids)
            if a.request_id not in live:
                continue  # ended while the step ran (stop string, abort): not counted
            drafts += 1
            proposed += a.num_proposed
            taken += len(acc)
            for i in range(len(acc)):
                per_pos[i] = per_pos.get(i, 0) + 1
            if spec is not None:
                spec.observe(a.request_id, a.num_proposed, len(acc))
        lm.spec_drafts.inc(drafts)
        lm.spec_draft_tokens.inc(proposed)
        lm.spec_accepted.inc(taken)
        lm.spec_emitted.inc(taken + drafts)
        for pos, count in per_pos.items():
            metrics.spec_accepted_per_pos.labels(position=str(pos), **lm.labels).inc(count)
        return accepted

    @property
    def _constrained(self) -> bool:
        return any(c.request.grammar is not None for _, c in self.choices.values())

    def _advance_grammars(self, sched: Scheduler, sampled: dict[str, int]) -> None:
        """Feed the constrained requests their sampled tokens and compute their next masks
        (all together); end those whose grammar is complete (stop) or at a dead end."""
        reqs: list[Request] = []
        tokens: list[int] = []
        for rid, token in sampled.items():
            entry = self.choices.get(rid)
            if entry is not None:
                req = entry[1].request
                if req.grammar is not None and not req.status.finished:
                    reqs.append(req)
                    tokens.append(token)
        self.grammars.advance([(r.grammar, t) for r, t in zip(reqs, tokens, strict=True)])
        for req in reqs:
            g = req.grammar
            if g.dead:
                sched.finish(req.request_id, Status.FINISHED_GRAMMAR)
            elif g.complete:
                sched.finish(req.request_id, Status.FINISHED_STOPPED)

    def _fail_requests(self, failed: Iterable[cpb.RequestFailure]) -> None:
        """The compute plane failed these alone: end their streams with the error."""
        for f in failed:
            if (entry := self.choices.get(f.request_id)) is not None:
                self._fail_stream(entry[0], RequestFailed(f.code, f.message))

    def _fail_stream(self, stream: GenerateStream, error: Exception) -> None:
        """End one stream with an error; its choices' blocks are freed at once."""
        stream.fail(error)
        self.outputs.remove(stream)
        for c in stream.choices:
            if not c.finished and self.scheduler is not None:
                self.scheduler.abort(c.request.request_id)
        metrics.request_success.labels(finished_reason="error", **self.labels).inc()
        if self._held and self.scheduler is not None:
            self._next_suspect()

    def _quarantine(self) -> None:
        """The compute plane failed with a step in flight: its requests are suspects; one
        that was in flight MAX_COMPUTE_FAILURES times in a row is failed, not re-sent."""
        # Each request once per failure, whichever of the steps in flight hold it.
        reqs = {req: None for out in self._in_flight for req, _ in out.scheduled()}
        self._in_flight.clear()
        for req in reqs:
            rid = req.request_id
            count = self._suspects[rid] = self._suspects.get(rid, 0) + 1
            if count >= MAX_COMPUTE_FAILURES and (entry := self.choices.get(rid)) is not None:
                del self._suspects[rid]
                log.error(
                    "request failed: in flight each of %d times the compute plane failed",
                    count,
                    extra={"request_id": entry[0].stream_id},
                )
                message = (
                    f"the compute plane failed {count} times in a row while computing this "
                    "request; it is not retried"
                )
                self._fail_stream(entry[0], RequestFailed("INTERNAL", message))

    def _clear_suspects(self, out: SchedulerOutput) -> None:
        """A step ran: its requests are no longer suspects (the count is "in a row")."""
        for req, _ in out.scheduled():
            self._suspects.pop(req.request_id, None)
        for rid in [r for r in self._suspects if r not in self.choices]:
            del self._suspects[rid]  # ended meanwhile
        if self._held:
            self._next_suspect()

    def _observe_pool(self) -> None:
        """Gauges and the counters the scheduler keeps, pushed to Prometheus."""
        sched = self.scheduler
        if sched is None:
            return
        m = self.labels
        st = sched.make_stats()
        lm = self._loop_metrics
        lm.running.set(st.num_running)
        lm.waiting.set(st.num_waiting)
        lm.kv_usage.set(st.kv.usage)
        for key, now, counter in (
            ("preemptions", st.num_preemptions, metrics.preemptions),
            ("queries", st.kv.prefix_queries, metrics.prefix_queries),
            ("hits", st.kv.prefix_hits, metrics.prefix_hits),
        ):
            if now > self._seen[key]:
                counter.labels(**m).inc(now - self._seen[key])
                self._seen[key] = now

    def _to_step(self, out: SchedulerOutput) -> cpb.StepRequest:
        step = cpb.StepRequest(step_id=self._step_id, finished_ids=out.finished_ids)
        for s in out.new:
            r = s.request
            step.new_requests.add(
                request_id=r.request_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=s.num_computed_tokens,
                num_scheduled_tokens=s.num_scheduled_tokens,
                block_ids=s.block_ids,
                sampling=r.sampling,
                traceparent=r.traceparent,
            )
        # One token in the blocks it holds: the id alone says it.
        decode_ids = [r.request_id for r in out.decodes]
        for c in out.continuing:
            if c.num_scheduled_tokens == 1 and not c.new_block_ids:
                decode_ids.append(c.request.request_id)
            else:
                step.continuing.add(
                    request_id=c.request.request_id,
                    new_block_ids=c.new_block_ids,
                    num_scheduled_tokens=c.num_scheduled_tokens,
                )
        step.decode_ids.extend(decode_ids)
        for req, proposal in out.proposals.items():
            if isinstance(proposal, int):
                step.proposals.add(request_id=req.request_id, num_draft_tokens=proposal)
            else:
                step.proposals.add(request_id=req.request_id, token_ids=proposal)
        for req, n in out.scheduled():
            g = req.grammar
            if (
                g is not None
                and g.mask is not None
                and req.num_computed_tokens + n == req.num_tokens
            ):
                mask = step.masks.add()
                mask.CopyFrom(g.mask)
                mask.request_id = req.request_id
        return step

    def _emit(
        self,
        result: cpb.StepResult,
        sampled: dict[str, int],
        accepted: dict[str, list[int]] | None = None,
    ) -> None:
        """Step k's tokens to their streams (while step k+1 runs)."""
        self.outputs.process(result, sampled, self._loop_metrics, accepted)

    def _finish_request(self, request_id: str, status: Status) -> None:
        if self.scheduler is not None:
            self.scheduler.finish(request_id, status)

    def _observe_finished(self, stream: GenerateStream) -> None:
        now = time.monotonic()
        m = self.labels
        first = stream.choices[0].request
        reason = first.status.value
        log.info(
            "request finished (%s): %d prompt tokens, %d generated in %.3f s",
            reason,
            len(stream.prompt_token_ids),
            sum(c.request.num_output_tokens for c in stream.choices),
            now - stream.arrival_time,
            extra={"request_id": stream.stream_id},
        )
        metrics.request_success.labels(finished_reason=reason, **m).inc()
        stream.span.set(
            {
                "gen_ai.response.finish_reasons": reason,
                "gen_ai.usage.output_tokens": sum(
                    c.request.num_output_tokens for c in stream.choices
                ),
                "hetero.cached_prompt_tokens": stream.num_cached_tokens,
            }
        )
        stream.span.end()
        metrics.e2e.labels(**m).observe(now - stream.arrival_time)
        scheduled = min((c.request.first_scheduled_time or now) for c in stream.choices)
        metrics.queue_time.labels(**m).observe(scheduled - stream.arrival_time)
        first_token = stream.first_token_time or now
        metrics.prefill_time.labels(**m).observe(first_token - scheduled)
        metrics.decode_time.labels(**m).observe(now - first_token)

    def _park(self) -> None:
        """Keep every request (tokens and all) for the next compute plane; drop the pool."""
        sched = self.scheduler
        self.scheduler = None
        if sched is None:
            return
        parked: list[tuple[Request, Request | None]] = [
            (r, None) for r in (*sched.running, *sched.waiting)
        ]
        for parent_id, siblings in sched.pending_forks.items():
            parked += [(s, sched.requests[parent_id]) for s in siblings]
        for req, _ in parked:
            req.drop_pending()  # the steps in flight are lost: their tokens never came
            req.num_computed_tokens = 0
            req.sent_to_compute = False
            req.status = Status.WAITING
        self._parked = parked + self._held
        self._held = []

    def _readmit(self) -> None:
        """Queue the parked requests on the new scheduler, suspects one at a time (the
        rest wait in `_held`); those that no longer fit fail."""
        parked, self._parked = self._parked, []
        on_trial = False
        for req, parent in parked:
            if req.request_id in self._suspects:
                if on_trial:
                    self._held.append((req, parent))
                    continue
                on_trial = True
            self._queue_again(req, parent)
        if parked:
            log.info(
                "re-admitted %d requests after reattaching (%d suspects wait their turn)",
                len(parked) - len(self._held),
                len(self._held),
            )
            self._wake.set()

    def _queue_again(self, req: Request, parent: Request | None) -> None:
        sched = self.scheduler
        assert sched is not None
        entry = self.choices.get(req.request_id)
        if entry is None:
            return  # cancelled while the compute plane was away
        try:
            sched.add_request(req, fork_of=parent)
        except (AdmissionError, QueueFullError) as e:
            self._fail_stream(entry[0], e)

    def _next_suspect(self) -> None:
        """The suspect on trial ran a step or ended: queue the next one."""
        held = {r.request_id for r, _ in self._held}
        if any(rid in self.choices and rid not in held for rid in self._suspects):
            return  # one is still on trial
        while self._held:
            req, parent = self._held.pop(0)
            if req.request_id in self.choices:
                self._queue_again(req, parent)
                self._wake.set()
                return

    def _fail_all(self, error: Exception) -> None:
        for stream in list(self.streams.values()):
            stream.fail(ComputeUnavailable(f"compute plane lost: {error}"))
        self.streams.clear()
        self.choices.clear()
        self._parked, self._held, self._suspects = [], [], {}
        self.scheduler = None
        metrics.compute_attached.labels(**self.labels).set(0)
        metrics.requests_running.labels(**self.labels).set(0)
        metrics.requests_waiting.labels(**self.labels).set(0)
        metrics.kv_cache_usage.labels(**self.labels).set(0)
