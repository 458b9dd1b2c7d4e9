"""One compute plane the control plane drives: its link, its block pool and its step loop.

A control plane drives any number of them (data parallel; `ControlEngine` places each
request on one and moves requests between them when one leaves). Each has its own
scheduler (KV memory is per compute plane), its own `Run` stream and its own asyncio
task: steps on different compute planes run concurrently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from control_plane import metrics
from control_plane.block_pool import BlockHash
from control_plane.compute_client import (
    ComputeLink,
    ComputeLinkError,
    StepFailed,
    sampled_tokens,
)
from control_plane.input_processor import ModelBounds
from control_plane.request import Request, Status
from control_plane.scheduler import AdmissionError, QueueFullError, Scheduler, SchedulerOutput
from control_plane.speculative import Speculator
from hetero_proto import compute_pb2 as cpb

if TYPE_CHECKING:
    from control_plane.engine import ControlEngine

log = logging.getLogger(__name__)

# A request in flight this many times in a row when a compute plane failed is failed,
# not re-admitted: a request that crashes every compute plane must not crash them all.
MAX_COMPUTE_FAILURES = 2
# Compute planes that fail within this many seconds of each other may be one outage (a
# node lost, several pods killed at once): a request lost with one goes on trial on a
# plane only once that plane was seen up longer than this after the loss, so a plane dying
# in the same outage never has it in flight, and the outage counts once against it.
SAME_OUTAGE_SECONDS = 0.5


@dataclasses.dataclass(slots=True)
class Suspect:
    """A request in flight when a compute plane failed, until a step of it runs."""

    failures: int  # failures in a row it was in flight for
    lost_at: float  # time.monotonic() of the last


class ComputeUnavailable(RuntimeError):
    """No compute plane is attached (or the one holding a request stayed away)."""


class RequestFailed(RuntimeError):
    """One request failed (the compute plane refused it or it raised there, or it was in
    flight each time a compute plane failed twice in a row); the others go on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # gRPC status code name


class PlaneUnfit(ComputeLinkError):
    """The compute plane cannot serve what this control plane was configured for
    (speculative decoding it cannot verify or draft), serves another model than the
    compute planes attached, or a model of another vocabulary than this control plane's
    tokenizer: it is not attached (its step stream closed, free for another
    control plane), one ERROR line says why, the gauge hetero_compute_unfit{reason} is 1
    for it, and it is tried again. `reason` is one of UNFIT_REASONS."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        assert reason in UNFIT_REASONS, reason
        self.reason = reason


# Why a compute plane was refused (a bounded label set): it cannot run the configured
# speculation, its model's shape, vocabulary or weights are not those of the planes
# attached, or its vocabulary is not this control plane's tokenizer's.
UNFIT_REASONS = ("speculation", "shape", "vocabulary", "weights", "tokenizer")


class _Leave(Exception):
    """The plane left the list of compute planes: its requests move to the others."""


class _LoopMetrics:
    """The labelled children of the metrics the step loop observes, looked up once.

    `labels()` costs a lock and a dict lookup; at 256 running sequences the step loop
    would pay it 500 times a step.
    """

    def __init__(self, labels: dict[str, str], plane_labels: dict[str, str]) -> None:
        self.generation_tokens = metrics.generation_tokens.labels(**labels)
        self.steps = metrics.steps.labels(planned_ahead="false", **plane_labels)
        self.steps_ahead = metrics.steps.labels(planned_ahead="true", **plane_labels)
        self.ttft = metrics.ttft.labels(**labels)
        self.itl = metrics.itl.labels(**labels)
        self.running = metrics.requests_running.labels(**plane_labels)
        self.waiting = metrics.requests_waiting.labels(**plane_labels)
        self.kv_usage = metrics.kv_cache_usage.labels(**plane_labels)
        # (bound here, so that they read 0 from the start: a series that appears at 1
        # loses its first event to rate() and increase())
        self.preemptions = metrics.preemptions.labels(**plane_labels)
        self.prefix_queries = metrics.prefix_queries.labels(**plane_labels)
        self.prefix_hits = metrics.prefix_hits.labels(**plane_labels)
        self.spec_drafts = metrics.spec_drafts.labels(**labels)
        self.spec_draft_tokens = metrics.spec_draft_tokens.labels(**labels)
        self.spec_accepted = metrics.spec_accepted_tokens.labels(**labels)
        self.spec_emitted = metrics.spec_emitted_tokens.labels(**labels)
        self.labels = labels


def plans_ahead(setting: bool | None, device: str, concurrent: bool) -> bool:
    """Async scheduling for a compute plane on `device` ("cpu", "cuda:0"): as set, or
    when unset, on for a GPU that runs its steps beside this process (`concurrent`: not
    an in-process engine, which runs a step only when its result is asked for)."""
    if setting is not None:
        return setting
    return concurrent and device.startswith("cuda")


def steps_ahead(setting: int | None, device: str) -> int:
    """With async scheduling, the steps planned beyond the one awaited: as set, or when
    unset 2 for a GPU (step k+2 leaves when step k's result arrives: the round trip and the
    compute plane's input build hide behind two device steps, where on the H200 one step
    of a 0.6B model, 1-1.6 ms, left the device idle a quarter of the time) and 1 for a
    CPU, whose step is long beside the round trip."""
    if setting is not None:
        return setting
    return 2 if device.startswith("cuda") else 1


class ComputePlane:
    def __init__(self, engine: ControlEngine, link: ComputeLink) -> None:
        self.engine = engine
        self.client = link
        self.address = link.address
        self.scheduler: Scheduler | None = None
        self.description: cpb.DescribeResponse | None = None
        # While attaching: its description, once the engine's check_model passed it (until
        # attached or refused; a plane attaching beside it is checked against it too).
        self.checked: cpb.DescribeResponse | None = None
        self.attached = asyncio.Event()
        self._wake = asyncio.Event()
        self._step_id = 0
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        self._lost = False  # set by the watchdog when the compute plane stops answering
        self._lost_since = 0.0
        self._compute_draining = False  # the compute plane said so: start nothing new on it
        # --async-scheduling, resolved at each attach (unset: on when the compute plane
        # runs on a GPU, in another process)
        self.async_scheduling = False
        self.steps_ahead = 1  # --steps-ahead, resolved at each attach
        self.leaving = False  # gone from the list of compute planes: hand requests over
        self.refused = False  # its last attach found another control plane driving it
        self._unfit: str | None = None  # why its last attach refused it (PlaneUnfit)
        # Requests kept across a compute-plane failure, in re-admission order, with the
        # request whose prompt blocks they fork (n > 1) or None.
        self._parked: list[tuple[Request, Request | None]] = []
        # The steps sent whose results are not back, oldest first: one, or with async
        # scheduling up to 1 + steps_ahead (the next ones planned while the compute plane
        # runs the first).
        self._in_flight: deque[SchedulerOutput] = deque()
        # Per step in flight: whether it was counted ahead (Scheduler.advance, resolved when
        # its result comes) or is applied as planned one at a time (Scheduler.update, which
        # also takes accepted proposals): a step that proposes, or carries grammar masks,
        # is planned with nothing in flight and none planned behind it.
        self._advanced: deque[bool] = deque()
        # Per step in flight: its wall-clock marks in this loop (schedule start, scheduled,
        # encoded, sent, previous outputs emitted), for `ControlEngine.timeline`.
        self._marks: deque[list[int]] = deque()
        # Requests in flight when the compute plane failed, until a step of theirs runs.
        # They go back one at a time: the others wait in `_held` until the one on trial
        # has run a step (or ended), so a request that crashes the compute plane again is
        # alone among the suspects when it does; and only once this plane was seen up
        # SAME_OUTAGE_SECONDS after the suspect was lost (`_up_at`).
        self._suspects: dict[str, Suspect] = {}
        self._held: list[tuple[Request, Request | None]] = []
        # time.monotonic() when the compute plane last showed it was up: attached, a step's
        # result, a health check answered.
        self._up_at = 0.0
        # Prompt blocks (chain-hash keys) of the requests placed here and still live: a
        # request sharing them goes here even before they are computed and cached.
        self.placed_keys: Counter[BlockHash] = Counter()
        self.labels = engine.labels
        self.plane_labels = {**engine.labels, "compute": self.address}
        self._loop_metrics = _LoopMetrics(self.labels, self.plane_labels)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"step-loop {self.address}")
        self._watchdog = asyncio.create_task(self._watch(), name=f"watchdog {self.address}")

    async def stop(self) -> None:
        for task in (self._task, self._watchdog):
            if task:
                task.cancel()
        await self.client.close()

    def wake(self) -> None:
        self._wake.set()

    def leave(self) -> None:
        """Hand this plane's requests to the other planes once its steps in flight are
        back, then stop (the engine closes the link)."""
        self.leaving = True
        self._wake.set()

    @property
    def unfit(self) -> str | None:
        """Why its last attach refused it as unfit (PlaneUnfit), else None."""
        return self._unfit

    @property
    def accepting(self) -> bool:
        """Whether new requests may be placed here."""
        return (
            self.attached.is_set()
            and self.scheduler is not None
            and not self._compute_draining
            and not self.leaving
            and not self._lost
        )

    @property
    def load(self) -> int:
        """Requests placed here and not finished: running, waiting and set aside."""
        sched = self.scheduler
        n = len(self._parked) + len(self._held)
        if sched is not None:
            n += len(sched.requests)
        return n

    def prefix_hit(self, keys: list[BlockHash]) -> int:
        """How many leading blocks of a prompt (`keys`: its chain of full-block hashes)
        this plane has cached, or holds for a live request placed here."""
        sched = self.scheduler
        cached = sched.block_manager.pool.cached if sched is not None else {}
        placed = self.placed_keys
        n = 0
        for key in keys:
            if key not in placed and key not in cached:
                break
            n += 1
        return n

    def bounds(self) -> ModelBounds:
        sched = self.scheduler
        assert sched is not None
        d = self.description
        eos = set(self.engine.tokenizer.eos_token_ids) | set(d.eos_token_ids if d else ())
        return ModelBounds(sched.max_model_len, d.vocab_size if d else 0, frozenset(eos))

    async def _attach(self) -> None:
        try:
            await self._attach_checked()
        except ComputeLinkError as e:
            # Its model passed the check (`checked`), then the attach failed otherwise
            # (another control plane drives it, the link dropped): it is unfit no more.
            if self.checked is not None and not isinstance(e, PlaneUnfit):
                self._fits()
            raise
        finally:
            self.checked = None

    async def _attach_checked(self) -> None:
        d = await self.client.attach(check=lambda d: self.engine.check_model(self, d))
        num_blocks = min(d.num_kv_blocks, self.engine.config.max_num_blocks or d.num_kv_blocks)
        max_len = min(d.max_model_len, self.engine.config.max_model_len or d.max_model_len)
        max_len = min(max_len, (num_blocks - 1) * d.block_size)
        self.scheduler = Scheduler(
            num_blocks=num_blocks,
            block_size=d.block_size,
            max_model_len=max_len,
            max_num_seqs=self.engine.config.max_num_seqs,
            max_num_batched_tokens=self.engine.config.max_num_batched_tokens,
            max_waiting=self.engine.config.max_waiting,
            enable_prefix_caching=self.engine.config.enable_prefix_caching,
            sliding_window=d.sliding_window or None,
            speculator=self._speculator(d),
        )
        self.description = d
        self.async_scheduling = plans_ahead(
            self.engine.config.async_scheduling, d.device, self.client.concurrent
        )
        self.steps_ahead = steps_ahead(self.engine.config.steps_ahead, d.device)
        self.engine.grammars.bind(d.vocab_size, self.bounds().eos_token_ids)
        self._compute_draining = False
        self._up_at = time.monotonic()
        self._readmit()
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        metrics.compute_attached.labels(**self.plane_labels).set(1)
        self.attached.set()
        self.refused = False
        self._fits()
        self.engine.plane_attached(self)
        log.info(
            "attached compute plane %s: %s on %s, %d blocks of %d, max_model_len %d, "
            "async scheduling %s",
            self.address,
            d.model_name,
            d.device,
            num_blocks,
            d.block_size,
            max_len,
            f"on ({self.steps_ahead} steps ahead)" if self.async_scheduling else "off",
        )

    def _speculator(self, d: cpb.DescribeResponse) -> Speculator | None:
        """Speculative decoding as configured, where the compute plane can verify it."""
        spec = self.engine.config.speculation
        if spec is None:
            return None
        # Refused, not served without speculation: it was asked for (as vLLM refuses a
        # speculative config it cannot run).
        if d.max_speculative_tokens < 1:
            raise PlaneUnfit(
                f"--speculative {spec.method}: the compute plane at {self.address} verifies "
                "no proposals (its --max-speculative-tokens is 0)",
                "speculation",
            )
        if spec.method == "draft" and not d.draft_model:
            raise PlaneUnfit(
                f"--speculative draft: the compute plane at {self.address} holds no draft "
                "model (start it with --draft-model)",
                "speculation",
            )
        if spec.num_tokens > d.max_speculative_tokens:
            log.warning(
                "--num-speculative-tokens %d capped at the compute plane's "
                "--max-speculative-tokens %d",
                spec.num_tokens,
                d.max_speculative_tokens,
            )
            spec = dataclasses.replace(spec, num_tokens=d.max_speculative_tokens)
        for pos in range(spec.num_tokens):  # (known labels read 0 from the start)
            metrics.spec_accepted_per_pos.labels(position=str(pos), **self.labels)
        log.info(
            "speculative decoding: %s, k <= %d, while <= %d requests decode%s",
            spec.method,
            spec.num_tokens,
            spec.max_batch,
            f" (draft model {d.draft_model})" if spec.method == "draft" else "",
        )
        return Speculator(spec)

    # ------------------------------------------------------------ step loop
    async def _run(self) -> None:
        """Attach, run steps, and on a failure keep the requests: they move to another
        compute plane at once where one accepts requests, else wait for this one to
        come back (up to compute_timeout)."""
        backoff = 0.2
        failures = 0  # of the step loop itself (a bug): waits grow from 1 s to a minute
        while True:
            try:
                if not self.attached.is_set():
                    if self.leaving and not self._parked and not self._held:
                        self.engine.plane_gone(self)  # (passed over, or gone from the list)
                        return
                    await self._attach()
                    backoff = 0.2
                await self._loop()
            except asyncio.CancelledError:
                raise
            except _Leave:
                self._detach()
                if not self._parked and not self._held:
                    self.engine.plane_gone(self)
                    return
                if self.engine.rehome(self):
                    log.info("compute plane %s left: its requests moved", self.address)
                    return
                self.leaving = False  # nowhere to go: carry on here
                continue
            except (ComputeLinkError, StepFailed) as e:
                now = time.monotonic()
                if isinstance(e, PlaneUnfit):  # (tried again, in case it is restarted)
                    await self.client.detach()
                    self._unfit_gauge(e.reason)
                    if self._unfit != str(e):
                        log.error("compute plane %s not attached: %s", self.address, e)
                    self._unfit = str(e)
                    self.engine.plane_unfit(self.address, e)
                if not self.attached.is_set() and getattr(e, "code", "") == "FAILED_PRECONDITION":
                    if not self.refused:
                        log.info("compute plane %s: %s", self.address, e)
                    self.refused = True  # another control plane drives it
                if getattr(e, "stopped", False):  # a planned stop (a drain that timed
                    self._forget_in_flight()  # out), no crash: its requests are no suspects
                else:
                    self._quarantine()
                if self.attached.is_set():
                    self._detach()
                    self._lost_since = now
                    left = len(self._parked)
                    if getattr(e, "stopped", False) and not left:  # SIGTERM: a planned stop
                        log.info("compute plane %s drained and stopped", self.address)
                    elif getattr(e, "stopped", False):
                        log.warning(
                            "compute plane %s stopped with %d requests unfinished (its drain"
                            " timed out)",
                            self.address,
                            left,
                        )
                    else:
                        log.error("compute plane %s lost: %s", self.address, e)
                if self._parked and self.engine.rehome(self):
                    pass  # moved to the other compute planes
                elif self._parked and now - self._lost_since > self.engine.config.compute_timeout:
                    log.error(
                        "compute plane %s away for %.0f s: failing its requests",
                        self.address,
                        now - self._lost_since,
                    )
                    self._fail_all(ComputeUnavailable(f"compute plane lost: {e}"))
                elif self._parked:
                    log.info(
                        "%d requests wait for compute plane %s to come back",
                        len(self._parked),
                        self.address,
                    )
                if self.leaving and not self._parked:
                    self.engine.plane_gone(self)  # gone from the list, nothing of its own left
                    return
                never_attached = self.description is None
                if never_attached and getattr(e, "code", "") == "UNAVAILABLE":
                    # Not listening yet, or loading its model: a compute plane started
                    # with this control plane (`serve`) is attached within 0.1 s of
                    # serving, not up to 2 s later.
                    await asyncio.sleep(0.1)
                    continue
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:
                # A bug here: say so, and fail every request of this plane (those the
                # scheduler holds, and any whose last tokens were not yet emitted) rather
                # than leave them waiting on a loop that is gone, with the plane still
                # reported attached; then attach afresh.
                log.exception("compute plane %s: the step loop failed", self.address)
                self._forget_in_flight()
                if self.attached.is_set():
                    self._detach()
                elif self.scheduler is not None:  # (attaching failed part-way)
                    self._park()
                message = "the control plane failed while running this request (see its log)"
                self._fail_all(RequestFailed("INTERNAL", message), every=True)
                if self.leaving:
                    self.engine.plane_gone(self)
                    return
                await asyncio.sleep(min(2.0**failures, 60.0))
                failures += 1

    def _fits(self) -> None:
        """Its model passed the check: no longer refused as unfit."""
        self._unfit = None
        self._unfit_gauge(None)

    def _unfit_gauge(self, reason: str | None) -> None:
        """hetero_compute_unfit: 1 for the reason its last attach refused it, 0 for the
        others (all 0 once its model passed the check)."""
        for r in UNFIT_REASONS:
            metrics.compute_unfit.labels(**self.plane_labels, reason=r).set(1 if r == reason else 0)

    def _detach(self) -> None:
        """The step stream is over: keep the requests (parked), drop the block pool."""
        self.attached.clear()
        self._lost = False
        metrics.compute_attached.labels(**self.plane_labels).set(0)
        self._park()
        self._observe_pool()
        self.engine.plane_detached(self)

    async def _watch(self, interval: float = 0.5) -> None:
        """Notice a dead compute plane while idle (a step in flight notices by itself)."""
        misses = 0
        while True:
            await asyncio.sleep(interval)
            if not self.attached.is_set():
                misses = 0
                continue
            alive = await self.client.alive()
            misses = misses + 1 if alive is False else 0
            if alive:
                self._seen_up()
            if misses >= 2:
                self._lost = True
                self._wake.set()

    async def _idle(self) -> None:
        """Until woken; ComputeLinkError as soon as the step stream ends by itself (the
        compute plane stopped, or died on this host: not ~1 s later from two missed
        health checks)."""
        wake = asyncio.ensure_future(self._wake.wait())
        ended = asyncio.ensure_future(self.client.ended())
        try:
            await asyncio.wait((wake, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            ended.cancel()
        if ended.done() and not ended.cancelled():
            raise ended.result()

    async def _loop(self) -> None:
        """Schedule, send the step, and while it runs turn the previous step's tokens into
        responses (detokenising, stop strings): output processing overlaps the compute
        plane's step instead of delaying the next one, as in vLLM's async output
        processing. A stop string found there ends its request one step late (or more,
        with steps planned ahead): the tokens sampled for it since are dropped, never sent
        or counted.

        With async scheduling the next steps are planned and sent before the result of the
        one in flight (Scheduler.advance / resolve), up to `steps_ahead` of them: the
        compute plane finds the next one queued when it finishes a step, so it never waits
        for the control plane's round trip. EOS and max_tokens then also end a request up
        to `steps_ahead` steps late (the tokens sampled for it meanwhile are dropped).
        Steps that need the previous step's tokens (grammar masks, speculative proposals)
        are planned with nothing in flight."""
        sched = self.scheduler
        assert sched is not None
        in_flight = self._in_flight
        # Sampled (and accepted proposals), not yet emitted.
        ready: tuple[cpb.StepResult, dict[str, int], dict[str, list[int]] | None] | None = None
        marks = self._marks
        advanced = self._advanced
        while True:
            out = None
            t_sched = time.time_ns()
            lookahead = bool(in_flight)
            if (
                not self._lost
                and not self.leaving
                and sched.has_work
                and (not lookahead or self._may_look_ahead(sched))
            ):
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
                if self.leaving:
                    raise _Leave()
                self._observe_pool()
                self._wake.clear()
                await self._idle()
                continue
            mark = None
            if out is not None:
                self._step_id += 1
                t_scheduled = time.time_ns()
                step = self._to_step(out)
                t_encoded = time.time_ns()
                (self._loop_metrics.steps_ahead if lookahead else self._loop_metrics.steps).inc()
                in_flight.append(out)
                ahead = self.async_scheduling and (lookahead or self._may_look_ahead(sched))
                advanced.append(ahead)
                # (with the step, so that the three stay paired; sent and emitted to come)
                mark = [t_sched, t_scheduled, t_encoded, 0, 0]
                marks.append(mark)
                try:
                    await self.client.send(step)
                finally:
                    mark[3] = time.time_ns()
                    if ready is not None:  # emitted even when the link fails: kept tokens
                        self._emit(*ready)
                        ready = None
                if ahead:
                    sched.advance(out)
            if ready is not None:
                self._emit(*ready)
                ready = None
            if mark is not None:
                mark[4] = time.time_ns()
                if (
                    len(in_flight) <= self.steps_ahead
                    and advanced[-1]
                    and self._may_look_ahead(sched)
                ):
                    continue  # plan the next step while those in flight run
            result = await self.client.receive()
            t_result = time.time_ns()
            self._up_at = time.monotonic()
            done = in_flight.popleft()
            was_advanced = advanced.popleft()
            mark = marks.popleft()  # (kept or not)
            if self._suspects:
                self._clear_suspects(done)
            if result.failed:
                self._fail_requests(result.failed)
            if result.draining and not self._compute_draining:
                log.info("compute plane %s is draining: it starts no new request", self.address)
                self._compute_draining = True
                self._shed_waiting()
            sampled = sampled_tokens(result)
            accepted = None
            if was_advanced:
                sched.resolve(done, sampled)
            else:
                accepted = self._accepted(sched, result) if result.accepted else None
                sched.update(done, sampled, accepted)
            if self._constrained:
                self._advance_grammars(sched, sampled)
            ready = result, sampled, accepted
            self._observe_pool()
            if self.engine.timeline is not None:
                t0, t1, t2, t3, t4 = mark
                self.engine.timeline.append(
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
                        # (CUDA: the device's idle time before the step, its own events)
                        **(
                            {"device_idle_ns": result.device_idle_ns}
                            if result.HasField("device_idle_ns")
                            else {}
                        ),
                    }
                )

    def _may_look_ahead(self, sched: Scheduler) -> bool:
        """Whether the next step may be planned before the result of the one in flight:
        async scheduling is on, no lookahead step left a request short of blocks, and no
        request needs the tokens in flight to be planned (grammar masks, proposals)."""
        return (
            self.async_scheduling
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
        return any(c.request.grammar is not None for _, c in self.engine.choices.values())

    def _advance_grammars(self, sched: Scheduler, sampled: dict[str, int]) -> None:
        """Feed the constrained requests their sampled tokens and compute their next masks
        (all together); end those whose grammar is complete (stop) or at a dead end."""
        reqs: list[Request] = []
        tokens: list[int] = []
        for rid, token in sampled.items():
            entry = self.engine.choices.get(rid)
            if entry is not None:
                req = entry[1].request
                if req.grammar is not None and not req.status.finished:
                    reqs.append(req)
                    tokens.append(token)
        self.engine.grammars.advance([(r.grammar, t) for r, t in zip(reqs, tokens, strict=True)])
        for req in reqs:
            g = req.grammar
            if req.status.finished:  # another choice's grammar error failed its stream
                continue
            if g.error and (entry := self.engine.choices.get(req.request_id)) is not None:
                n = req.num_output_tokens
                message = f"{g.kind}: the grammar failed after {n} tokens: {g.error}"
                failed = RequestFailed("INVALID_ARGUMENT", message)
                self.engine._fail_stream(entry[0], failed)
            elif g.dead:
                sched.finish(req.request_id, Status.FINISHED_GRAMMAR)
            elif g.complete:
                sched.finish(req.request_id, Status.FINISHED_STOPPED)

    def _fail_requests(self, failed: Iterable[cpb.RequestFailure]) -> None:
        """The compute plane failed these alone: end their streams with the error."""
        for f in failed:
            if (entry := self.engine.choices.get(f.request_id)) is not None:
                self.engine._fail_stream(entry[0], RequestFailed(f.code, f.message))

    def _forget_in_flight(self) -> None:
        """The steps in flight are lost with the step stream: expect no result of them."""
        self._in_flight.clear()
        self._advanced.clear()
        self._marks.clear()

    def _quarantine(self) -> None:
        """The compute plane failed with a step in flight: its requests are suspects; one
        that was in flight MAX_COMPUTE_FAILURES times in a row is failed, not re-sent."""
        # Each request once per failure, whichever of the steps in flight hold it.
        reqs = {req: None for out in self._in_flight for req, _ in out.scheduled()}
        self._forget_in_flight()
        now = time.monotonic()
        for req in reqs:
            rid = req.request_id
            suspect = self._suspects.setdefault(rid, Suspect(0, now))
            suspect.failures += 1
            suspect.lost_at = now
            count = suspect.failures
            if (
                count >= MAX_COMPUTE_FAILURES
                and (entry := self.engine.choices.get(rid)) is not None
            ):
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
                self.engine._fail_stream(entry[0], RequestFailed("INTERNAL", message))

    def _seen_up(self) -> None:
        """The compute plane answered a health check: a held suspect may go on trial."""
        self._up_at = time.monotonic()
        if self._held and self.scheduler is not None:
            self._next_suspect()

    def _may_try(self, request_id: str) -> bool:
        """Whether a suspect may go on trial here: this plane was seen up long enough
        after the suspect was lost not to be part of the same outage."""
        suspect = self._suspects.get(request_id)
        return suspect is None or self._up_at > suspect.lost_at + SAME_OUTAGE_SECONDS

    def _clear_suspects(self, out: SchedulerOutput) -> None:
        """A step ran: its requests are no longer suspects (the count is "in a row")."""
        for req, _ in out.scheduled():
            self._suspects.pop(req.request_id, None)
        for rid in [r for r in self._suspects if r not in self.engine.choices]:
            del self._suspects[rid]  # ended meanwhile
        if self._held:
            self._next_suspect()

    def observe_queue(self) -> None:
        """The running and waiting gauges as of now: a request placed or aborted between
        steps (a CPU prefill step can take seconds) counts at once, not after the step."""
        sched, lm = self.scheduler, self._loop_metrics
        set_aside = len(self._parked) + len(self._held)
        lm.running.set(len(sched.running) if sched is not None else 0)
        lm.waiting.set((len(sched.waiting) if sched is not None else 0) + set_aside)

    def _observe_pool(self) -> None:
        """Gauges and the counters the scheduler keeps, pushed to Prometheus. Without a
        compute plane nothing runs: the requests kept for it wait (moved, they count on
        the plane that took them)."""
        sched = self.scheduler
        lm = self._loop_metrics
        set_aside = len(self._parked) + len(self._held)
        if sched is None:
            lm.running.set(0)
            lm.waiting.set(set_aside)
            lm.kv_usage.set(0)
            return
        st = sched.make_stats()
        lm.running.set(st.num_running)
        lm.waiting.set(st.num_waiting + set_aside)
        lm.kv_usage.set(st.kv.usage)
        for key, now, counter in (
            ("preemptions", st.num_preemptions, lm.preemptions),
            ("queries", st.kv.prefix_queries, lm.prefix_queries),
            ("hits", st.kv.prefix_hits, lm.prefix_hits),
        ):
            if now > self._seen[key]:
                counter.inc(now - self._seen[key])
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
        self.engine.outputs.process(result, sampled, self._loop_metrics, accepted)

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

    def _shed_waiting(self) -> None:
        """The compute plane drains: its waiting requests (of one choice) move to the
        other compute planes rather than wait for it to be replaced."""
        sched = self.scheduler
        if sched is None or not any(
            p.accepting for p in self.engine.planes.values() if p is not self
        ):
            return
        moving: list[tuple[Request, Request | None]] = []
        for req in list(sched.waiting):
            entry = self.engine.choices.get(req.request_id)
            if entry is None or len(entry[0].choices) != 1:
                continue
            sched.abort(req.request_id)  # frees its blocks; the compute plane forgets it
            req.drop_pending()
            req.status = Status.WAITING
            req.num_computed_tokens = 0
            moving.append((req, None))
        if moving:
            self._parked.extend(moving)
            self.engine.rehome(self)

    def _readmit(self) -> None:
        """Queue the parked requests on the new scheduler, suspects one at a time (the
        rest wait in `_held`); those that no longer fit fail."""
        parked, self._parked = self._parked, []
        on_trial = False
        for req, parent in parked:
            if req.request_id in self._suspects:
                if on_trial or not self._may_try(req.request_id):
                    self._held.append((req, parent))
                    continue
                on_trial = True
            self._queue_again(req, parent)
        if parked:
            log.info(
                "compute plane %s: %d requests re-admitted (%d suspects wait their turn)",
                self.address,
                len(parked) - len(self._held),
                len(self._held),
            )
            self._wake.set()

    def _queue_again(self, req: Request, parent: Request | None) -> None:
        sched = self.scheduler
        assert sched is not None
        entry = self.engine.choices.get(req.request_id)
        if entry is None:
            return  # cancelled while the compute plane was away
        try:
            sched.add_request(req, fork_of=parent)
        except (AdmissionError, QueueFullError) as e:
            self.engine._fail_stream(entry[0], e)

    def _next_suspect(self) -> None:
        """The suspect on trial ran a step or ended, or the plane was seen up: queue the
        next one (once the plane may try it)."""
        held = {r.request_id for r, _ in self._held}
        if any(rid in self.engine.choices and rid not in held for rid in self._suspects):
            return  # one is still on trial
        while self._held:
            req, parent = self._held[0]
            if req.request_id in self.engine.choices and not self._may_try(req.request_id):
                return  # until the plane is seen up after the outage that lost it
            self._held.pop(0)
            if req.request_id in self.engine.choices:
                self._queue_again(req, parent)
                self._wake.set()
                return

    def _fail_all(self, failure: Exception, every: bool = False) -> None:
        """Fail the requests this plane keeps with `failure` (the compute plane stayed
        away and no other takes its requests); with `every`, also every other stream
        placed here (the step loop failed: some had left the scheduler, finished, with
        their last tokens not yet emitted)."""
        streams = {}
        for req, _ in self._parked + self._held:
            if (entry := self.engine.choices.get(req.request_id)) is not None:
                streams[entry[0].stream_id] = entry[0]
        if every:
            for stream, _ in list(self.engine.choices.values()):
                if stream.plane is self:
                    streams[stream.stream_id] = stream
        self._parked, self._held, self._suspects = [], [], {}
        for stream in streams.values():
            self.engine._fail_stream(stream, failure)
        self.scheduler = None
        self._observe_pool()
