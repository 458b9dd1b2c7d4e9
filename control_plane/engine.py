"""The control plane's engine: admits requests, runs the step loop, streams outputs.

One asyncio task drives the attached compute plane: schedule -> send the step ->
push the previous step's deltas to their streams while it runs -> await its result ->
update the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from control_plane import metrics
from control_plane.compute_client import (
    ComputeClient,
    ComputeLink,
    ComputeLinkError,
    StepFailed,
    sampled_tokens,
)
from control_plane.config import ControlConfig
from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.outputs import Choice, GenerateStream, Outbox
from control_plane.request import Request, Status
from control_plane.scheduler import AdmissionError, QueueFullError, Scheduler, SchedulerOutput
from control_plane.stop import StopChecker
from control_plane.tokenizer import TokenizerWrapper
from hetero_common.limits import MAX_N, MAX_STOP_CHARS, MAX_STOPS
from hetero_common.logs import choice_request_id, valid_request_id
from hetero_common.sampling_params import SamplingSpec
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb

log = logging.getLogger(__name__)


class ComputeUnavailable(RuntimeError):
    """No compute plane is attached."""


@dataclass
class ModelLimits:
    max_model_len: int
    vocab_size: int


class _LoopMetrics:
    """The labelled children of the metrics the step loop observes, looked up once.

    `labels()` costs a lock and a dict lookup; at 256 running sequences the step loop
    would pay it 500 times a step.
    """

    def __init__(self, labels: dict[str, str]) -> None:
        self.generation_tokens = metrics.generation_tokens.labels(**labels)
        self.ttft = metrics.ttft.labels(**labels)
        self.itl = metrics.itl.labels(**labels)
        self.running = metrics.requests_running.labels(**labels)
        self.waiting = metrics.requests_waiting.labels(**labels)
        self.kv_usage = metrics.kv_cache_usage.labels(**labels)


class ControlEngine:
    def __init__(
        self, config: ControlConfig, tokenizer: TokenizerWrapper, link: ComputeLink | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.client: ComputeLink = link or ComputeClient(config.compute, config.compute_tls)
        self.scheduler: Scheduler | None = None
        self.description: cpb.DescribeResponse | None = None
        self.streams: dict[str, GenerateStream] = {}
        self.choices: dict[str, tuple[GenerateStream, Choice]] = {}
        self._wake = asyncio.Event()
        self._step_id = 0
        self._task: asyncio.Task[None] | None = None
        self.attached = asyncio.Event()
        self._set_model_label("unknown")
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        self._lost = False  # set by the watchdog when the compute plane stops answering
        self._lost_since = 0.0
        self._compute_draining = False  # the compute plane said so: start nothing new on it
        self.draining = False  # this process is shutting down: refuse new requests
        # Requests kept across a compute-plane failure, in re-admission order, with the
        # request whose prompt blocks they fork (n > 1) or None.
        self._parked: list[tuple[Request, Request | None]] = []
        self._watchdog: asyncio.Task[None] | None = None

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
        )
        self.description = d
        self._compute_draining = False
        self._readmit()
        self._set_model_label(d.model_name)
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
    ) -> GenerateStream:
        """Admit a request (n choices). Raises AdmissionError / QueueFullError / ComputeUnavailable.

        `request_id` (the client's, e.g. the gateway's X-Request-Id) names the request in
        the logs of this plane and the compute plane: it is the stream's id when no
        running stream has it (choices are `<id>-<i>` toward the compute plane).

        Its responses go to the stream's queue, or with `outbox` into that GenerateMany
        call's next message under `client_id`; with `packed` (the client reads packed
        deltas) its plain deltas go packed when it has one choice and no logprobs.
        """
        sched = self.scheduler
        if self.draining:
            raise ComputeUnavailable("the control plane is shutting down")
        if sched is None or not self.attached.is_set():
            raise ComputeUnavailable("no compute plane is attached")
        n = params.n or 1
        if not 1 <= n <= MAX_N:
            raise AdmissionError(f"n must be in 1..{MAX_N}, got {n}")
        if params.max_tokens < 0 or params.min_tokens < 0:
            raise AdmissionError("max_tokens and min_tokens must be >= 0")
        if len(params.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in params.stop):
            raise AdmissionError(
                f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters"
            )
        if not prompt_ids:
            raise AdmissionError("the prompt is empty")
        if len(prompt_ids) >= sched.max_model_len:
            raise AdmissionError(
                f"the prompt has {len(prompt_ids)} tokens; the maximum context length is "
                f"{sched.max_model_len} tokens, prompt and output together"
            )
        vocab = self.description.vocab_size if self.description else 0
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise AdmissionError(f"prompt token ids must be in 0..{vocab - 1}")
        max_tokens = params.max_tokens or sched.max_model_len - len(prompt_ids)
        if params.min_tokens > max_tokens:
            raise AdmissionError(
                f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})"
            )
        eos_ids = set(self.tokenizer.eos_token_ids) | set(
            self.description.eos_token_ids if self.description else ()
        )
        usable = valid_request_id(request_id) and request_id not in self.streams
        stream_id = request_id if usable else uuid.uuid4().hex
        stream = GenerateStream(
            stream_id, list(prompt_ids), [], self.tokenizer, outbox=outbox, client_id=client_id
        )
        for i in range(n):
            sampling = cpb.SamplingParams(
                temperature=params.temperature,
                top_p=params.top_p or 1.0,
                top_k=max(0, params.top_k),
                min_p=params.min_p,
                repetition_penalty=params.repetition_penalty or 1.0,
                frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty,
                logprobs=params.logprobs,
                top_logprobs=params.top_logprobs,
            )
            if params.min_tokens:
                # The compute plane masks these until min_tokens tokens exist.
                banned = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
                sampling.min_tokens = params.min_tokens
                sampling.min_tokens_banned_ids.extend(sorted(banned))
            if params.HasField("seed"):
                sampling.seed = (params.seed + i) % (1 << 64)
            problem = SamplingSpec.from_proto(sampling).validate()
            if problem:
                raise AdmissionError(problem)
            req = Request(
                request_id=choice_request_id(stream_id, i),
                prompt_token_ids=list(prompt_ids),
                max_tokens=max_tokens,
                sampling=sampling,
                min_tokens=params.min_tokens,
                ignore_eos=params.ignore_eos,
                eos_token_ids=frozenset(eos_ids),
                stop_token_ids=frozenset(params.stop_token_ids),
            )
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            stream.choices.append(Choice(i, req, detok, StopChecker(list(params.stop))))
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
        if (
            outbox is not None
            and packed
            and n == 1
            and not (params.logprobs or params.top_logprobs)
        ):
            stream.pack_into = outbox
        self.streams[stream_id] = stream
        log.info(
            "request admitted: %d prompt tokens, %d choices, max_tokens %d",
            len(prompt_ids),
            n,
            max_tokens,
            extra={"request_id": stream_id},
        )
        metrics.prompt_tokens.labels(**self.labels).inc(len(prompt_ids))
        for c in stream.choices:
            self.choices[c.request.request_id] = (stream, c)
        # The first message says "admitted" at once, before any token: a gateway can then
        # send its HTTP head knowing the request was not refused.
        admitted = stream.new_response()
        admitted.prompt_token_ids.extend(prompt_ids)
        stream.send(admitted)
        self._wake.set()
        return stream

    def abort(self, stream: GenerateStream) -> None:
        """Cancel a stream's unfinished choices now; their blocks are freed at once."""
        if self.streams.pop(stream.stream_id, None) is None:
            return
        for c in stream.choices:
            self.choices.pop(c.request.request_id, None)
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
        step's token for it is dropped, never sent or counted."""
        sched = self.scheduler
        assert sched is not None
        ready: tuple[cpb.StepResult, dict[str, int]] | None = None  # sampled, not yet emitted
        while True:
            out = None
            if not self._lost and sched.has_work:
                out = sched.schedule(admit=not self._compute_draining)
            if out is None or out.empty:
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
            self._step_id += 1
            step = self._to_step(out)
            try:
                await self.client.send(step)
            finally:
                if ready is not None:
                    self._emit(*ready)
                    ready = None
            result = await self.client.receive()
            if result.draining and not self._compute_draining:
                log.info("the compute plane is draining: new requests wait for the next one")
                self._compute_draining = True
            sampled = sampled_tokens(result)
            sched.update(out, sampled)
            ready = result, sampled
            self._observe_pool()

    def _observe_pool(self) -> None:
        """Gauges and the counters the scheduler keeps, pushed to Prometheus."""
        sched = self.scheduler
        if sched is None:
            return
        m = self.labels
        bm = sched.block_manager
        lm = self._loop_metrics
        lm.running.set(len(sched.running))
        lm.waiting.set(len(sched.waiting))
        lm.kv_usage.set(bm.usage)
        for key, now, counter in (
            ("preemptions", sched.num_preemptions, metrics.preemptions),
            ("queries", bm.prefix_queries, metrics.prefix_queries),
            ("hits", bm.prefix_hits, metrics.prefix_hits),
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
        return step

    def _emit(self, result: cpb.StepResult, sampled: dict[str, int]) -> None:
        """Hand each stream its new tokens: every `stream_interval` tokens, and the first and
        last at once. Detokenising, stop strings and the response happen only then."""
        sched = self.scheduler
        assert sched is not None
        touched: dict[str, tuple[GenerateStream, pb.GenerateResponse]] = {}
        interval = self.config.stream_interval
        running, waiting = Status.RUNNING, Status.WAITING
        now = time.monotonic()
        missing = 0
        gaps: list[float] = []  # inter-token latencies seen by this step's tokens
        logprobs = {r.request_id: r for r in result.results} if result.results else None
        choices = self.choices
        for rid, token in sampled.items():
            entry = choices.get(rid)
            if entry is None:
                missing += 1
                continue  # aborted while the step ran
            stream, choice = entry
            if (last := choice.last_token_time) is not None:
                gaps.append(now - last)
            elif stream.first_token_time is None:  # the stream's first token (any choice)
                stream.first_token_time = now
                self._loop_metrics.ttft.observe(now - stream.arrival_time)
            choice.last_token_time = now
            pending = choice.pending
            pending.append(token)
            if logprobs is not None and rid in logprobs:
                choice.pending_logprobs.append(logprobs[rid])
            req = choice.request
            # A request that got a token goes on unless this token finished it. It may be
            # waiting: preempted by the next step's plan, made before this emit.
            live = (status := req.status) is running or status is waiting
            if len(pending) < interval and live and choice.sent:
                continue
            if req.num_cached_tokens > 0 and choice.index == 0:
                stream.num_cached_tokens = req.num_cached_tokens
            choice.sent = True
            box = stream.pack_into if live else None
            # The common case, packed; inlined rather than through new_text (a call per
            # token costs ~0.05 ms a step at 256).
            if box is not None and not choice.stop.stop:
                push = choice.detok.push
                text = push(token) if len(pending) == 1 else "".join(map(push, pending))
                box.delta(stream.client_id, pending, text)
                pending.clear()
                continue
            text, num_sent, matched = stream.new_text(choice, pending)
            if matched is None and box is not None:
                box.delta(stream.client_id, pending, text)
                pending.clear()
                continue
            if (out := touched.get(stream.stream_id)) is None:
                out = touched[stream.stream_id] = (stream, stream.new_response())
            delta = stream.add_delta(choice, out[1], pending[:num_sent], text)
            pending.clear()
            choice.pending_logprobs.clear()
            if matched is not None:
                req.stop_reason = matched
                sched.finish(req.request_id, Status.FINISHED_STOPPED)
                # Also when the scheduler ended it by length: the text ends at the stop string.
                req.status = Status.FINISHED_STOPPED
                live = False
            if not live:
                stream.finish(choice, delta, req.status)
                self.choices.pop(req.request_id, None)
        self._loop_metrics.generation_tokens.inc(len(sampled) - missing)
        for value, count in Counter(gaps).items():
            metrics.observe_many(self._loop_metrics.itl, value, count)
        for stream, resp in touched.values():
            if ended := stream.done:
                self._observe_finished(stream)
                resp.usage.CopyFrom(stream.usage())
                self.streams.pop(stream.stream_id, None)
            stream.send(resp, ended)

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
            req.num_computed_tokens = 0
            req.sent_to_compute = False
            req.status = Status.WAITING
        self._parked = parked

    def _readmit(self) -> None:
        """Queue the parked requests on the new scheduler; those that no longer fit fail."""
        sched = self.scheduler
        assert sched is not None
        parked, self._parked = self._parked, []
        for req, parent in parked:
            entry = self.choices.get(req.request_id)
            if entry is None:
                continue  # cancelled while the compute plane was away
            try:
                sched.add_request(req, fork_of=parent)
            except (AdmissionError, QueueFullError) as e:
                stream = entry[0]
                stream.fail(e)
                self.abort(stream)
        if parked:
            log.info("re-admitted %d requests after reattaching", len(parked))
            self._wake.set()

    def _fail_all(self, error: Exception) -> None:
        for stream in list(self.streams.values()):
            stream.fail(ComputeUnavailable(f"compute plane lost: {error}"))
        self.streams.clear()
        self.choices.clear()
        self._parked = []
        self.scheduler = None
        metrics.compute_attached.labels(**self.labels).set(0)
        metrics.requests_running.labels(**self.labels).set(0)
        metrics.requests_waiting.labels(**self.labels).set(0)
        metrics.kv_cache_usage.labels(**self.labels).set(0)
