"""The control plane's engine: admits requests, places each on a compute plane, streams
outputs.

Each compute plane is a `ComputePlane` (control_plane/plane.py) with its own block pool
and step loop: schedule -> send the step -> push the previous step's deltas to their
streams while it runs -> await its result -> update the scheduler. The engine owns what
they share: the tokenizer, the input and output processors (every live stream), the
placement of new requests (longest prefix-cache hit, then load) and the moves of
requests off a compute plane that failed or left.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from control_plane import metrics
from control_plane.block_pool import BlockHash, chain_hashes, root_hash
from control_plane.compute_client import ComputeClient, ComputeLink
from control_plane.config import ControlConfig
from control_plane.grammar import GrammarError, Grammars
from control_plane.input_processor import InputProcessor
from control_plane.output_processor import OutputProcessor
from control_plane.outputs import Choice, GenerateStream, Outbox
from control_plane.plane import (
    MAX_COMPUTE_FAILURES,
    ComputePlane,
    ComputeUnavailable,
    PlaneUnfit,
    RequestFailed,
)
from control_plane.request import Request, Status
from control_plane.scheduler import AdmissionError, Scheduler
from control_plane.tokenizer import TokenizerWrapper
from hetero_common import vocab, weights
from hetero_common.discovery import resolve, static_addresses
from hetero_common.logs import valid_request_id
from hetero_common.metrics import forget_series
from hetero_common.tracing import start_span
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb

__all__ = [
    "MAX_COMPUTE_FAILURES",
    "ComputeUnavailable",
    "ControlEngine",
    "RequestFailed",
]

log = logging.getLogger(__name__)

# With max_compute_planes, a compute plane another control plane drives is tried again
# after this long (meanwhile the others are).
REFUSED_RETRY_SECONDS = 30.0


def model_shape(d: cpb.DescribeResponse) -> dict[str, object]:
    """What two compute planes must share to serve one model (a request moves between
    them): not their model names, which differ for the same model in another form (a GGUF
    file's general.name, an HF folder's name; quantized or not), but its vocabulary and
    shape. A model of the same tokenizer and another size differs here."""
    return {
        "vocabulary": d.vocab_size,
        "architecture": d.architecture,
        "layers": d.num_layers,
        "hidden size": d.hidden_size,
        "attention heads": d.num_attention_heads,
        "KV heads": d.num_kv_heads,
        "head size": d.head_dim,
    }


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


def prompt_keys(token_ids: list[int], block_size: int, cache_salt: str = "") -> list[BlockHash]:
    """The chain of full-block hashes of a prompt under its cache salt, as the prefix
    cache keys them (the last token is never a hit: it must be computed)."""
    stop = (len(token_ids) - 1) // block_size
    return list(chain_hashes(token_ids, block_size, 0, stop, root_hash(cache_salt)))


class ControlEngine:
    def __init__(
        self,
        config: ControlConfig,
        tokenizer: TokenizerWrapper,
        link: ComputeLink | None = None,
        model_name: str = "unknown",
        grammars: Grammars | None = None,
    ) -> None:
        """`link`: drive this one compute plane (offline, benchmarks, tests); without it
        the engine drives the compute planes `config.compute` names (a list; host names
        resolve to every address, re-resolved while it runs).
        `model_name`: the served model's id (ModelInfo's), the metrics' model_name label.
        `grammars`: compiled grammars to share with earlier engines of this tokenizer
        (OfflineLLM's generates), else a cache of `config.grammar_cache_mb` of its own."""
        self.config = config
        self.tokenizer = tokenizer
        self.grammars = (
            grammars
            if grammars is not None
            else Grammars(tokenizer, config.grammar_cache_mb * 2**20)
        )
        # What a compute plane's model must have (check_model); built here, not in the
        # event loop at the first attach.
        self.vocab = tokenizer.vocab_fingerprint
        self.inputs = InputProcessor(tokenizer, self.grammars)
        self.outputs = OutputProcessor(
            config.stream_interval, self._finish_request, self._observe_finished
        )
        # The live streams and choices (the output processor's, shared).
        self.streams: dict[str, GenerateStream] = self.outputs.streams
        self.choices: dict[str, tuple[GenerateStream, Choice]] = self.outputs.choices
        self.attached = asyncio.Event()  # set while any compute plane is attached
        self.served = False  # a compute plane was attached once
        # Set when the first compute plane cannot serve this configuration (PlaneUnfit):
        # a start-up error (`unfit` says why), not a control plane serving without it.
        self.unfit_at_start = asyncio.Event()
        self.unfit: str = ""
        self.labels = {"model_name": model_name}
        # Counters read 0 from the start (a series that appears at 1 loses its first
        # event to rate() and increase()); the per-compute ones are bound by each plane.
        metrics.prompt_tokens.labels(**self.labels)
        for reason in (*(s.value for s in Status if s.finished), "error"):
            metrics.request_success.labels(finished_reason=reason, **self.labels)
        # So do the finished requests' histograms (their _count is a counter too); time to
        # first token and inter-token latency are bound by each plane.
        finished = (metrics.e2e, metrics.queue_time, metrics.prefill_time, metrics.decode_time)
        for histogram in finished:
            histogram.labels(**self.labels)
        self.draining = False  # this process is shutting down: refuse new requests
        self._link = link
        self.planes: dict[str, ComputePlane] = {}  # by address, in the order they joined
        self._discovery: asyncio.Task[None] | None = None
        # With max_compute_planes: addresses another control plane drove, skipped until.
        self._passed_over: dict[str, float] = {}
        # The compute planes listed (--compute, as last read), and why those found unfit
        # before any attached were (a start-up error once they all were).
        self._listed: list[str] = []
        self._unfit_seen: dict[str, str] = {}
        # benchmarks.profile sets a list: one record of wall-clock marks (ns) per step.
        self.timeline: list[dict[str, int]] | None = None

    # ------------------------------------------------------------ lifecycle
    def warm_up(self) -> None:
        """Before serving, build what the first request of a kind would otherwise build
        while other requests stream: with --grammar-warmup, llguidance's view of the
        vocabulary (seconds on Gemma 3's, holding the GIL; shared by the engines of one
        tokenizer, so built once)."""
        if self.config.grammar_warmup and not self.grammars.warmed:
            t0 = time.perf_counter()
            self.grammars.warm()
            log.info(
                "structured output: llguidance's view of the %d-token vocabulary ready in %.2f s",
                self.tokenizer.vocab_size,
                time.perf_counter() - t0,
            )

    async def start(self) -> None:
        if self._link is not None:
            self._listed = [self._link.address]
            self._add_plane(self._link)
            return
        spec = self.config.compute
        if (found := static_addresses(spec)) is not None:
            self._update_planes(found)
            if not self.config.max_compute_planes or len(found) <= self.config.max_compute_planes:
                return
            # (more than the cap: the list is gone through again, so that a plane passed
            # over, another control plane's or unfit, makes room for the next one listed)
        else:
            self._update_planes(await resolve(spec) or {})
        self._discovery = asyncio.create_task(self._discover(), name="compute-discovery")

    async def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        for plane in list(self.planes.values()):
            await plane.stop()

    async def _discover(self) -> None:
        """Re-resolve the compute planes' addresses: new ones join, gone ones leave."""
        while True:
            await asyncio.sleep(self.config.compute_resolve_interval)
            try:
                addresses = await resolve(self.config.compute)
            except ValueError as e:  # a malformed file this time: keep what we have
                log.error("compute planes: %s", e)
                continue
            if addresses is not None:  # None: the resolver failed; keep what we have
                self._update_planes(addresses)

    def _update_planes(self, addresses: dict[str, str]) -> None:
        """Start driving the compute planes new in `addresses` (address -> host name),
        up to max_compute_planes; those no longer in it leave. With a cap, a plane that
        another control plane drives makes room for one not tried lately."""
        cap = self.config.max_compute_planes
        now = time.monotonic()
        self._listed = list(addresses)
        self._passed_over = {a: t for a, t in self._passed_over.items() if t > now}
        if cap:
            for address, plane in list(self.planes.items()):
                # (one found unfit too: it may come back with the right model, like a
                # driven one, but holds no place meanwhile)
                unused = plane.refused or plane.unfit is not None
                if unused and not plane.attached.is_set() and not plane.leaving:
                    self._passed_over[address] = now + REFUSED_RETRY_SECONDS
                    plane.leave()
        wanted = [a for a in addresses if a in self.planes and not self.planes[a].leaving]
        for a in addresses:
            if a in wanted or (cap and len(wanted) >= cap):
                continue
            if a not in self.planes and self._passed_over.get(a, 0.0) <= now:
                wanted.append(a)
        for address, plane in list(self.planes.items()):
            if address not in wanted and not plane.leaving:
                log.info("compute plane %s is gone from %s", address, self.config.compute)
                plane.leave()
        for address in wanted:
            if address not in self.planes:
                log.info("compute plane %s joins", address)
                tls = self.config.compute_tls
                self._add_plane(ComputeClient(address, tls, server_name=addresses[address]))

    def _add_plane(self, link: ComputeLink) -> ComputePlane:
        plane = ComputePlane(self, link)
        self.planes[link.address] = plane
        plane.start()
        return plane

    def plane_attached(self, plane: ComputePlane) -> None:
        self.attached.set()
        self.served = True

    async def first_attached(self) -> None:
        """Until a compute plane is attached; ValueError (why) when the first one cannot
        serve this configuration."""
        attached = asyncio.ensure_future(self.attached.wait())
        unfit = asyncio.ensure_future(self.unfit_at_start.wait())
        await asyncio.wait((attached, unfit), return_when=asyncio.FIRST_COMPLETED)
        attached.cancel()
        unfit.cancel()
        if not self.attached.is_set():
            raise ValueError(self.unfit)

    def plane_unfit(self, address: str, error: Exception) -> None:
        """The compute plane at `address` cannot serve this configuration: before any
        served, the control plane's start-up fails once every compute plane listed was
        found unfit (one that fits may still attach: which answers first is a race);
        later, that plane is left unattached."""
        if self.served or self.unfit_at_start.is_set():
            return
        self._unfit_seen[address] = str(error)
        if self._listed and all(a in self._unfit_seen for a in self._listed):
            self.unfit = "; ".join(dict.fromkeys(self._unfit_seen[a] for a in self._listed))
            self.unfit_at_start.set()

    def plane_detached(self, plane: ComputePlane) -> None:
        if not any(p.attached.is_set() for p in self.planes.values()):
            self.attached.clear()

    def plane_gone(self, plane: ComputePlane) -> None:
        """A plane that left handed its requests over: forget it."""
        if self.planes.get(plane.address) is plane:
            del self.planes[plane.address]
            forget_series(metrics.PER_COMPUTE, "compute", plane.address)
        asyncio.get_running_loop().create_task(plane.client.close())
        self.plane_detached(plane)

    def check_model(self, plane: ComputePlane, d: cpb.DescribeResponse) -> None:
        """PlaneUnfit for a compute plane that serves another model than the compute planes
        attached (its shape, vocabulary or weights differ: hetero_common.vocab and
        .weights; the same model in another form, GGUF or HF folder, quantized or not,
        agrees), or a model this control plane's tokenizer is not of. Those attached
        include any another check passed that is still attaching (else two planes of
        different models, met at once, both attached) and any lost one, this one included,
        whose requests wait for it: they would go on here."""
        for other in self.planes.values():
            od = other.checked if other.checked is not None else other.description
            attached = other.attached.is_set() or other.checked is not None
            if od is None or not (other.load > 0 or (attached and other is not plane)):
                continue
            mine, theirs = model_shape(d), model_shape(od)
            for key in mine:
                if mine[key] != theirs[key]:
                    does = (
                        "as it did for the requests that wait for it"
                        if other is plane
                        else f"as compute plane {other.address} does"
                    )
                    raise PlaneUnfit(
                        f"compute plane {plane.address} serves {d.model_name} "
                        f"({key} {mine[key]}), not {od.model_name} ({key} {theirs[key]}) {does}",
                        "shape",
                    )
            served = (
                "it served for the requests that wait for it"
                if other is plane
                else f"compute plane {other.address} serves"
            )
            if vocab.differ(od.vocab_fingerprint, d.vocab_fingerprint):
                raise PlaneUnfit(
                    f"compute plane {plane.address} serves {d.model_name}, whose vocabulary "
                    f"is not that of {od.model_name}, which {served}",
                    "vocabulary",
                )
            # The same shape and vocabulary, other weights (another fine-tune): a request
            # moved between them would go on under other weights.
            why = weights.difference(od.weights_fingerprint, d.weights_fingerprint)
            if why is not None:
                raise PlaneUnfit(
                    f"compute plane {plane.address} serves {d.model_name}, whose weights are "
                    f"not those of {od.model_name}, which {served}: {why}",
                    "weights",
                )
        if vocab.differ(self.vocab, d.vocab_fingerprint):
            same, compared = vocab.agreement(self.vocab, d.vocab_fingerprint)
            raise PlaneUnfit(
                f"--model {self.config.model}: the compute plane at {plane.address} serves "
                f"{d.model_name}, whose vocabulary is not this tokenizer's ({same} of "
                f"{compared} blocks of {vocab.BLOCK} token ids agree)",
                "tokenizer",
            )
        plane.checked = d

    @property
    def plane(self) -> ComputePlane | None:
        """The first attached compute plane, else the first one (single-plane callers)."""
        for p in self.planes.values():
            if p.attached.is_set():
                return p
        return next(iter(self.planes.values()), None)

    @property
    def scheduler(self) -> Scheduler | None:
        """The first attached compute plane's scheduler (ModelInfo, Tokenize)."""
        p = self.plane
        return p.scheduler if p is not None else None

    @property
    def schedulers(self) -> list[Scheduler]:
        """The schedulers of the attached compute planes."""
        return [
            p.scheduler
            for p in self.planes.values()
            if p.attached.is_set() and p.scheduler is not None
        ]

    @property
    def description(self) -> cpb.DescribeResponse | None:
        p = self.plane
        return p.description if p is not None else None

    def check_accepting(self) -> None:
        """Raise ComputeUnavailable now, as `submit` would, when no request can be placed:
        callers check before tokenising a prompt that would only be refused."""
        if self.draining:
            raise ComputeUnavailable("the control plane is shutting down")
        if not any(p.accepting for p in self.planes.values()):
            raise ComputeUnavailable("no compute plane is attached")

    async def prepare(self, params: pb.GenerationParams) -> None:
        """Before `submit`: compile the request's grammar off the event loop (cached;
        `Grammars.prepare`), so that admitting it takes no seconds on the loop.
        AdmissionError when it does not compile."""
        if params.HasField("structured"):
            try:
                await self.grammars.prepare(params.structured)
            except GrammarError as e:
                raise AdmissionError(str(e)) from None

    # ------------------------------------------------------------ placement
    def _place(
        self, token_ids: list[int], cache_salt: str, exclude: ComputePlane | None = None
    ) -> tuple[ComputePlane, str]:
        """The compute plane for a new request and why (`hetero_routed_requests_total`'s
        reason, counted by the caller once the request is placed there): the longest
        prefix-cache hit (blocks cached there or held by requests placed there), ties to
        the least loaded; the least loaded instead when the hit's plane has
        `route_load_slack` more requests."""
        planes = [p for p in self.planes.values() if p.accepting and p is not exclude]
        if not planes:
            raise ComputeUnavailable("no compute plane is attached")
        if len(planes) == 1:
            plane, reason = planes[0], "only"
        else:
            keys: dict[int, list[BlockHash]] = {}
            scored = []
            for p in planes:
                sched = p.scheduler
                assert sched is not None
                bs = sched.block_manager.block_size
                if bs not in keys:
                    keys[bs] = prompt_keys(token_ids, bs, cache_salt)
                hit = p.prefix_hit(keys[bs]) * bs
                scored.append((-hit, p.load, -sched.block_manager.num_free_blocks, p))
            least = min(scored, key=lambda s: (s[1], s[2]))
            best = min(scored, key=lambda s: s[:3])
            if best[0] == 0:
                plane, reason = best[3], "load"
            elif best[1] - least[1] > self.config.route_load_slack:
                plane, reason = least[3], "load"
            else:
                plane, reason = best[3], "prefix"
        return plane, "moved" if exclude is not None else reason

    def _count_routed(self, plane: ComputePlane, reason: str) -> None:
        metrics.routed.labels(compute=plane.address, reason=reason, **self.labels).inc()

    def _settle(self, stream: GenerateStream, plane: ComputePlane) -> None:
        """Record that `stream` lives on `plane` (its prompt blocks count there for the
        placement of later requests: with one compute plane there is nothing to place, and
        the prompt is not hashed here; blocks it has computed count through the cache)."""
        self._unsettle(stream)
        sched = plane.scheduler
        assert sched is not None
        stream.plane = plane
        if len(self.planes) > 1:
            bs = sched.block_manager.block_size
            salt = stream.choices[0].request.cache_salt
            stream.route_keys = prompt_keys(stream.prompt_token_ids, bs, salt)
            plane.placed_keys.update(stream.route_keys)

    def _unsettle(self, stream: GenerateStream) -> None:
        plane = stream.plane
        if plane is not None and stream.route_keys:
            placed = plane.placed_keys
            for key in stream.route_keys:
                if placed[key] <= 1:
                    placed.pop(key, None)
                else:
                    placed[key] -= 1
            stream.route_keys = []

    def rehome(self, src: ComputePlane) -> bool:
        """Move the requests `src` set aside (failed or left) to the other compute planes,
        tokens kept (they recompute there); False when none accepts requests."""
        if not any(p.accepting for p in self.planes.values() if p is not src):
            return False
        items = src._parked + src._held
        src._parked, src._held = [], []
        groups: dict[str, list[tuple[Request, Request | None]]] = {}
        streams: dict[str, GenerateStream] = {}
        for req, parent in items:
            if (entry := self.choices.get(req.request_id)) is None:
                continue  # ended meanwhile
            stream = entry[0]
            streams[stream.stream_id] = stream
            groups.setdefault(stream.stream_id, []).append((req, parent))
        touched: dict[str, ComputePlane] = {}
        for sid, group in groups.items():
            stream = streams[sid]
            first = group[0][0]
            target, reason = self._place(first.token_ids, first.cache_salt, exclude=src)
            self._count_routed(target, reason)
            self._settle(stream, target)
            for req, _ in group:
                if (suspect := src._suspects.pop(req.request_id, None)) is not None:
                    target._suspects[req.request_id] = suspect
            target._parked.extend(group)
            touched[target.address] = target
        for target in touched.values():
            target._readmit()
            target._observe_pool()
        src._observe_pool()
        log.info(
            "moved %d requests from compute plane %s to %s",
            len(streams),
            src.address,
            ", ".join(touched) or "none",
        )
        if src.leaving:
            self.plane_gone(src)
        return True

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
        num_resumed: int = 0,
    ) -> GenerateStream:
        """Admit a request (n choices). Raises AdmissionError / QueueFullError / ComputeUnavailable.

        `num_resumed`: the last ids of `prompt_ids` are output the client already has
        (a gateway continuing a request whose control plane failed): they count as
        output and are not sent again.

        `request_id` (the client's, e.g. the gateway's X-Request-Id) names the request in
        the logs of this plane and the compute plane: it is the stream's id when no
        running stream has it (choices are `<id>-<i>` toward the compute plane).
        `traceparent`: the caller's trace span, parent of this request's span here.

        Its responses go to the stream's queue, or with `outbox` into that GenerateMany
        call's next message under `client_id`; with `packed` (the client reads packed
        deltas) its plain deltas go packed when it has one choice and no logprobs.
        """
        if self.draining:
            raise ComputeUnavailable("the control plane is shutting down")
        if not prompt_ids:  # (before the resumed count's check, which would blame it)
            raise AdmissionError("the prompt is empty")
        if not 0 <= num_resumed < len(prompt_ids):
            raise AdmissionError(
                f"num_resumed_output_tokens must be in 0..{max(0, len(prompt_ids) - 1)} "
                "(the input holds the prompt, then the resumed output)"
            )
        resumed = prompt_ids[len(prompt_ids) - num_resumed :] if num_resumed else []
        prompt_ids = prompt_ids[: len(prompt_ids) - num_resumed]
        plane, reason = self._place(prompt_ids + resumed, params.cache_salt)
        sched = plane.scheduler
        assert sched is not None
        bounds = plane.bounds()
        max_tokens = self.inputs.check(prompt_ids, params, bounds)
        self.inputs.check_resumed(resumed, params, max_tokens, bounds)
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
            resumed,
        )
        self._trace(stream, traceparent, max_tokens)
        _queue(sched, stream)
        plane.observe_queue()
        self._count_routed(plane, reason)  # (a request refused above was placed nowhere)
        self._settle(stream, plane)
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
        plane.wake()
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
        self._end_choices(stream)

    def _end_choices(self, stream: GenerateStream) -> None:
        """Abort a removed (aborted or failed) stream's unfinished choices on its plane
        (blocks freed now)."""
        # Tokens held back by --stream-interval were generated: interval 1 counted them.
        if held := self.outputs.drop_held_back(stream):
            metrics.generation_tokens.labels(**self.labels).inc(held)
        plane = stream.plane
        self._unsettle(stream)
        if plane is None:
            return
        sched = plane.scheduler
        if plane._held and sched is not None:
            plane._next_suspect()
        for c in stream.choices:
            if not c.finished and sched is not None:
                sched.abort(c.request.request_id)
        plane.observe_queue()
        plane.wake()

    def _fail_stream(self, stream: GenerateStream, error: Exception) -> None:
        """End one stream with an error; its choices' blocks are freed at once."""
        stream.fail(error)
        self.outputs.remove(stream)
        metrics.request_success.labels(finished_reason="error", **self.labels).inc()
        self._end_choices(stream)

    def _finish_request(self, request_id: str, status: Status) -> None:
        entry = self.choices.get(request_id)
        plane = entry[0].plane if entry is not None else None
        if plane is not None and plane.scheduler is not None:
            plane.scheduler.finish(request_id, status)

    def _observe_finished(self, stream: GenerateStream) -> None:
        self._unsettle(stream)
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
