"""gRPC server of the control plane: the public ControlPlane API, health and reflection.

Errors are mapped here, in one place: bad input -> INVALID_ARGUMENT, a full queue ->
RESOURCE_EXHAUSTED, no compute plane -> UNAVAILABLE. Cancelling a Generate call
aborts its request and frees its KV blocks at once. SIGTERM drains: new requests get
UNAVAILABLE while those in flight finish (up to --drain-timeout), then the process exits.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from control_plane.block_pool import IntegrityError
from control_plane.chat_template import ChatTemplateError, read_chat_template
from control_plane.config import ControlConfig
from control_plane.engine import ComputeUnavailable, ControlEngine, RequestFailed
from control_plane.outputs import GenerateStream
from control_plane.scheduler import AdmissionError, QueueFullError, Scheduler
from control_plane.tokenizer import TokenizerError, TokenizerWrapper, load_tokenizer
from hetero_common.cpus import side_lane
from hetero_common.grpc_health import HealthReporter
from hetero_common.grpc_server import GrpcPlane
from hetero_common.limits import MAX_GRPC_MESSAGE_BYTES, MAX_RECEIVE_BYTES
from hetero_common.model_path import (
    ModelFileError,
    model_display_name,
    read_json_object,
    resolve_model_path,
)
from hetero_common.packed import PackedDeltaWriter
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ControlPlane"].full_name
# A text or chat larger than this is tokenised in the big-input lane (see `prompt_ids`).
# 64 KiB is ~16k tokens, tens of milliseconds to tokenise.
BIG_INPUT_BYTES = 64 << 10


class MessageTooLarge(ValueError):
    """A request message larger than MAX_GRPC_MESSAGE_BYTES (what gRPC refuses by default)."""


_STATUS = {
    MessageTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AdmissionError: grpc.StatusCode.INVALID_ARGUMENT,
    TokenizerError: grpc.StatusCode.INVALID_ARGUMENT,
    ChatTemplateError: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ComputeUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_for(e: BaseException) -> grpc.StatusCode | None:
    if isinstance(e, RequestFailed):
        return getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL)
    return next((code for kind, code in _STATUS.items() if isinstance(e, kind)), None)


async def _abort(context: grpc.aio.ServicerContext, e: Exception) -> None:
    """End the call with the status of an error of the caller's; raise any other (a bug)."""
    code = status_for(e)
    if code is None:
        raise e
    await context.abort(code, str(e))


def check_message_size(request: Any) -> None:
    """The server reads messages up to MAX_RECEIVE_BYTES, so that a GenerateMany start over
    the request limit is refused alone instead of ending the call and every request on it;
    each RPC then refuses such a message itself, as gRPC refused it before."""
    if (size := request.ByteSize()) > MAX_GRPC_MESSAGE_BYTES:
        raise MessageTooLarge(
            f"the request message is larger than the maximum ({size} vs. "
            f"{MAX_GRPC_MESSAGE_BYTES} bytes)"
        )


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    """A value of the call's gRPC metadata ("" when absent)."""
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("latin-1")
    return ""


class CallOutbox:
    """The next message of one GenerateMany call, filled in place as steps produce it.

    A step's responses are built straight into `message`, and its common deltas are
    packed into lists (`delta`); the call's writer takes the message whole when it
    wakes, so everything one step produced goes out together.

    A message is read responses first, then packed deltas. When the writer lags, a
    message can gather several steps: a full response of a request that already has a
    packed delta in it would then be read too early, so the message is closed there
    and the response starts the next one.
    """

    def __init__(self) -> None:
        # Requests whose last message is in `message`: (request id, its stream, or None
        # for a start that never had one). The stream tells it from a newer request that
        # took the id after a cancel while this one's last message waited here.
        self.ended: list[tuple[str, object]] = []
        self._ready = asyncio.Event()
        self._closed: list[pb.GenerateManyResponse] = []  # full, waiting to be written
        self._new_message()

    def _new_message(self) -> None:
        self.message = pb.GenerateManyResponse()
        self._packed = PackedDeltaWriter()

    def _close_message(self) -> None:
        self._closed.append(self._finish_message())
        self._new_message()

    def _finish_message(self) -> pb.GenerateManyResponse:
        message = self.message
        if self._packed:
            self._packed.write(message.packed)
        return message

    def _holds_something(self) -> bool:
        m = self.message
        return bool(m.responses or m.errors or self._packed)

    @property
    def empty(self) -> bool:
        """Nothing to write: the current message holds nothing and none is closed."""
        return not (self._closed or self._holds_something())

    def add(self, request_id: str) -> pb.GenerateResponse:
        if request_id in self._packed.seen:
            self._close_message()
        resp = self.message.responses.add()  # then set: add(**kwargs) is slower
        resp.request_id = request_id
        return resp

    def delta(self, request_id: str, token_ids: list[int], text: str) -> None:
        if not self._packed:  # the first of this message (the event stays set until `take`)
            self._ready.set()
        self._packed.add(request_id, token_ids, text)

    def sent(self, request_id: str, last: bool, *, owner: object = None) -> None:
        if last:
            self.ended.append((request_id, owner))
        self._ready.set()

    def fail(
        self, request_id: str, error: BaseException, *, end: bool = True, owner: object = None
    ) -> None:
        """`end` False: a start refused for its request_id, which names another request."""
        code = status_for(error) or grpc.StatusCode.INTERNAL
        self.message.errors.add(request_id=request_id, code=code.name, message=str(error))
        if end:
            self.ended.append((request_id, owner))
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    async def take(self) -> tuple[list[pb.GenerateManyResponse], list[tuple[str, object]]]:
        """Wait for something to send; return the messages (none when only woken) and
        the requests they end."""
        await self._ready.wait()
        self._ready.clear()
        messages = self._closed
        if self._holds_something():
            messages.append(self._finish_message())
        ended = self.ended
        self._closed, self.ended = [], []
        self._new_message()
        return messages, ended


class ControlServicer(pb_grpc.ControlPlaneServicer):
    def __init__(
        self,
        engine: ControlEngine,
        model_name: str,
        generation_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer: TokenizerWrapper = engine.tokenizer
        self.model_name = model_name
        self.generation_defaults = json.dumps(generation_defaults or {})
        self._big_lane = side_lane("tokenize-big")  # big inputs never take every CPU
        self.closing = False  # the server stops: end_calls ends the open calls
        self._calls: set[_ManyCall] = set()  # the open GenerateMany calls

    async def prompt_ids(
        self,
        request: pb.GenerateRequest | pb.TokenizeRequest,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """`_prompt_ids` in a worker thread (tokenising is slow; the tokenizer releases the
        GIL). A big input waits for the big-input lane, a pool of half the CPUs: a burst of
        huge prompts would otherwise fill every worker thread, and each small request
        would wait seconds behind them to be tokenised."""
        check_message_size(request)
        size = _input_bytes(request)
        self._check_size(size, request)  # before queueing: a refusal should not wait
        work = functools.partial(self._prompt_ids, request, add_special_tokens)
        if size <= BIG_INPUT_BYTES:
            return await asyncio.to_thread(work)
        run = functools.partial(contextvars.copy_context().run, work)  # as to_thread does
        return await asyncio.get_running_loop().run_in_executor(self._big_lane, run)

    async def admissible(self, request: pb.GenerateRequest) -> list[int]:
        """A generate request's prompt ids, once all that `submit` needs done off the event
        loop is done: a compute plane is there (UNAVAILABLE before any work), the prompt
        is tokenised and its grammar compiled."""
        self.engine.check_accepting()
        prompt_ids = await self.prompt_ids(request)
        await self.engine.prepare(request.params)
        return prompt_ids

    def _check_size(self, size: int, request: pb.GenerateRequest | pb.TokenizeRequest) -> None:
        """Refuse a text or chat too long for the context before spending seconds rendering
        and tokenising it."""
        sched = self.engine.scheduler
        if sched is None:
            return
        if size > sched.max_model_len * self.tokenizer.max_token_bytes:
            what = "chat" if request.HasField("chat") else "prompt"
            raise AdmissionError(
                f"the {what} ({size} bytes) is longer than the maximum context length of "
                f"{sched.max_model_len} tokens"
            )

    def _prompt_ids(
        self,
        request: pb.GenerateRequest | pb.TokenizeRequest,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """The request's prompt as token ids. `add_special_tokens` (the tokenizer's BOS)
        defaults to the input's kind: a text gets it, a chat does not (its template writes
        its own). Set for a chat (Tokenize's flag), the BOS goes on top of the rendered
        template, as vLLM's /tokenize does: a template that starts with one then has two.
        Runs in a worker thread: see `prompt_ids`."""
        which = request.WhichOneof("input")
        if which == "text":
            return self.tokenizer.encode(request.text, add_special_tokens is not False)
        if which == "token_ids":
            return list(request.token_ids.ids)  # type: ignore[union-attr]
        if which == "chat":
            chat = request.chat
            messages = chat_messages(chat)
            if not messages:
                raise AdmissionError("chat input has no messages")
            tools = _json(chat.tools_json, "tools_json", list)
            kwargs = _json(chat.template_kwargs_json, "chat_template_kwargs", dict)
            if chat.documents_json:
                kwargs["documents"] = _json(chat.documents_json, "documents", list)
            text = self.tokenizer.apply_chat_template(
                messages,
                chat.add_generation_prompt,
                tools or None,
                continue_final_message=chat.continue_final_message,
                kwargs=kwargs,
            )
            return self.tokenizer.encode(text, add_special_tokens is True)
        raise AdmissionError("no input: set text, token_ids or chat")

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            prompt_ids = await self.admissible(request)
            stream = self.engine.submit(
                prompt_ids,
                request.params,
                request_id=request.request_id,
                num_resumed=_resumed(request),
                traceparent=request.traceparent or _metadata(context, "traceparent"),
            )
        except Exception as e:
            await _abort(context, e)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    await context.abort(status_for(item) or grpc.StatusCode.INTERNAL, str(item))
                assert isinstance(item, pb.GenerateResponse)
                if request.request_id:
                    item.request_id = request.request_id
                yield item
                if item.HasField("usage"):
                    return
        finally:
            self.engine.abort(stream)  # no-op when finished; frees blocks when cancelled

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[pb.GenerateManyRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        call = _ManyCall(self)
        reader = asyncio.create_task(call.read(request_iterator))
        self._calls.add(call)
        try:
            # A refused start leaves `starting` before its error is written: the outbox
            # must be empty too, or the call could end with that error unsent.
            while call.reading or call.running or call.starting or not call.outbox.empty:
                if self.closing:
                    # end_calls: a status now, not a call left open for the stop's grace
                    # (the reader first: the abort would fail its read, logged as the
                    # client's fault)
                    reader.cancel()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the control plane stopped")
                messages, ended = await call.outbox.take()
                if call.broken is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, f"GenerateMany: {call.broken}")
                call.forget(ended)
                for message in messages:
                    yield message
        finally:
            self._calls.discard(call)
            reader.cancel()
            call.close()  # the client went away: free the blocks now

    def end_calls(self) -> None:
        """End the open GenerateMany calls now (the server stops, drained): a gateway
        keeps its call open while idle, and the server's stop grace waited a second for
        it, then cancelled it (an ERROR traceback from grpc). Each call is woken and ends
        itself between writes: a cancel could land in grpc's write of its last message,
        which then left the call to the grace ('Cancelling all calls')."""
        self.closing = True
        for call in self._calls:
            call.outbox.wake()

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            ids = await self.prompt_ids(request, request.add_special_tokens)
        except Exception as e:
            await _abort(context, e)
        sched = self.engine.scheduler
        return pb.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=sched.max_model_len if sched else 0
        )

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        try:
            check_message_size(request)
        except MessageTooLarge as e:
            await _abort(context, e)
        ids = list(request.token_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.tokenizer.vocab_size):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token ids must be in 0..{self.tokenizer.vocab_size - 1}",
            )
        # A thread: a million ids (a 4 MiB message) take a quarter second to decode.
        text = await asyncio.to_thread(self.tokenizer.decode, ids, request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        d = self.engine.description
        sched = self.engine.scheduler
        info = pb.ModelInfoResponse(
            model_name=self.model_name,
            vocab_size=self.tokenizer.vocab_size,
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            has_chat_template=bool(self.tokenizer.chat_template),
            # (false while draining: it takes no new request, as its health says, so
            # a gateway's /ready must not read it as ready)
            compute_attached=self.engine.attached.is_set() and not self.engine.draining,
            generation_defaults_json=self.generation_defaults,
            max_waiting=self.engine.config.max_waiting,
        )
        # Over every attached compute plane: the smallest context, all their blocks.
        scheds = self.engine.schedulers
        if d is not None and sched is not None and scheds:
            info.max_model_len = min(x.max_model_len for x in scheds)
            info.block_size = d.block_size
            info.num_kv_blocks = sum(x.block_manager.pool.num_blocks for x in scheds)
            info.architecture, info.dtype, info.device = d.architecture, d.dtype, d.device
            _fill_stats(info.stats, scheds, request.detailed)
            if sched.speculator is not None:
                info.speculative = sched.speculator.config.method
        return info


class _ManyCall:
    """The state of one GenerateMany call: its requests being tokenised and running, and
    the outbox their messages gather in."""

    def __init__(self, servicer: ControlServicer) -> None:
        self.servicer = servicer
        self.engine = servicer.engine
        self.outbox = CallOutbox()
        self.running: dict[str, GenerateStream] = {}  # client request id -> its stream
        self.starting: dict[str, object] = {}  # being tokenised: request id -> its token
        self.tasks: set[asyncio.Task[None]] = set()
        self.reading = True
        self.broken: BaseException | None = None  # the reader failed: end the call

    async def read(self, request_iterator: AsyncIterator[pb.GenerateManyRequest]) -> None:
        try:
            async for msg in request_iterator:
                which = msg.WhichOneof("action")
                if which == "start":
                    self._start(msg.start, msg.accept_packed)
                elif which == "cancel":
                    self.starting.pop(msg.cancel, None)
                    if (stream := self.running.pop(msg.cancel, None)) is not None:
                        self.engine.abort(stream)
                else:  # (a client's mistake, or an action this server does not know)
                    error = AdmissionError("a GenerateManyRequest must set start or cancel")
                    self.outbox.fail("", error, end=False)
        except Exception as e:
            # Starts and cancels could no longer be read: end the call, so that the
            # client sees it and opens another, rather than wait on it.
            log.exception("GenerateMany: reading the client's messages failed")
            self.broken = e
        finally:
            self.reading = False
            self.outbox.wake()

    def _start(self, request: pb.GenerateRequest, packed: bool) -> None:
        rid = request.request_id
        if not rid or rid in self.running or rid in self.starting:
            message = (
                f"request_id {rid!r}: GenerateMany needs a request_id that "
                "no unfinished request of this call has"
            )
            self.outbox.fail(rid, AdmissionError(message), end=False)
            return
        self.starting[rid] = token = object()
        task = asyncio.create_task(self._admit(request, token, packed))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _admit(self, request: pb.GenerateRequest, token: object, packed: bool) -> None:
        rid, starting = request.request_id, self.starting
        try:
            prompt_ids = await self.servicer.admissible(request)
            if starting.get(rid) is not token:
                return  # cancelled meanwhile (its id may have been reused since)
            self.running[rid] = self.engine.submit(
                prompt_ids,
                request.params,
                outbox=self.outbox,
                client_id=rid,
                packed=packed,
                request_id=rid,
                traceparent=request.traceparent,
                num_resumed=_resumed(request),
            )
        except Exception as e:
            if starting.get(rid) is not token:
                return  # cancelled meanwhile: its id may already name a newer request
            if status_for(e) is None:
                log.exception("GenerateMany request %s failed", rid)
            self.outbox.fail(rid, e)
        finally:
            if starting.get(rid) is token:
                del starting[rid]
            self.outbox.wake()  # the call may be waiting for its last request to end

    def forget(self, ended: list[tuple[str, object]]) -> None:
        """Stop tracking the requests whose last message goes out now: each by its stream,
        not a newer request that took its id after a cancel while that message waited."""
        running = self.running
        for rid, stream in ended:
            if rid in running and running[rid] is stream:
                del running[rid]

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for stream in self.running.values():
            self.engine.abort(stream)


def _input_bytes(request: pb.GenerateRequest | pb.TokenizeRequest) -> int:
    """The size of a text or chat input as sent. A chat counts whole (every field of every
    message, the tools, documents and template kwargs): cheap, and no field is left to
    hide a huge input in."""
    return len(request.text.encode()) + request.chat.ByteSize()  # (one of them is unset: 0)


def _resumed(request: pb.GenerateRequest) -> int:
    """num_resumed_output_tokens, which only a token-id input may carry."""
    n = request.num_resumed_output_tokens
    if n and request.WhichOneof("input") != "token_ids":
        raise AdmissionError("num_resumed_output_tokens needs a token_ids input")
    return n


def _fill_stats(st: pb.EngineStats, scheds: list[Scheduler], detailed: bool) -> None:
    """Counters always, summed over the compute planes' schedulers; with `detailed`, the
    walks over every page table too (KV slot use and the integrity check):
    O(blocks + tokens), so probes leave it off."""
    errors = []
    for sched in scheds:
        stats = sched.make_stats()
        st.num_free_kv_blocks += stats.kv.num_free_blocks
        st.num_usable_kv_blocks += stats.kv.num_usable_blocks
        st.num_running += stats.num_running
        st.num_waiting += stats.num_waiting
        st.num_preemptions += stats.num_preemptions
        st.prefix_cache_queries += stats.kv.prefix_queries
        st.prefix_cache_hits += stats.kv.prefix_hits
        if (spec := sched.speculator) is not None:
            st.num_spec_drafts += spec.num_drafts
            st.num_spec_draft_tokens += spec.num_draft_tokens
            st.num_spec_accepted_tokens += spec.num_accepted_tokens
        if not detailed:
            continue
        bm = sched.block_manager
        used, allocated = bm.slot_usage(sched.requests.values())
        st.num_kv_slots_used += used
        st.num_kv_slots_allocated += allocated
        try:
            bm.check_integrity()
        except IntegrityError as e:
            errors.append(str(e))
    if detailed:
        st.integrity_ok = not errors
        st.integrity_error = "; ".join(errors)


async def serve(config: ControlConfig) -> None:
    """Serve until SIGINT/SIGTERM, then drain: refuse new requests (UNAVAILABLE) and let
    those in flight finish, up to --drain-timeout."""
    path: Path = resolve_model_path(config.model)
    tokenizer = load_tokenizer(path)
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template)
        log.info("chat template from %s", config.chat_template)
    name = config.served_model_name or model_display_name(path)  # ModelInfo's and the metrics'
    engine = ControlEngine(config, tokenizer, model_name=name)
    engine.warm_up()  # (nothing served yet: no request waits for it)
    plane = GrpcPlane(config, SERVICE_NAME, max_receive_bytes=MAX_RECEIVE_BYTES)
    servicer = ControlServicer(engine, name, generation_defaults(path))
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, plane.server)
    await plane.start()
    await engine.start()
    log.info("control plane listening on %s, compute plane %s", plane.address, config.compute)
    watcher = asyncio.create_task(_follow_attachment(engine, plane.health))
    if await plane.before_stop(engine.unfit_at_start.wait()):
        watcher.cancel()
        await plane.close()
        await engine.stop()
        raise ValueError(engine.unfit)  # (no compute plane can serve it yet)
    watcher.cancel()
    engine.draining = True
    log.info(
        "control plane draining %d requests for up to %.0f s",
        len(engine.streams),
        config.drain_timeout,
    )
    if left := await plane.drain(lambda: len(engine.streams), config.drain_timeout):
        log.warning("drain timeout: %d requests cut off", left)
    log.info("control plane shutting down")
    servicer.end_calls()
    await plane.close()
    await engine.stop()


async def _follow_attachment(engine: ControlEngine, health: HealthReporter) -> None:
    """Health is SERVING only while a compute plane is attached."""
    serving: bool | None = None
    while True:
        now = engine.attached.is_set()
        if now != serving:
            await health.set(now)
            serving = now
        await asyncio.sleep(0.05)


# The generation_config.json fields that are request defaults (vLLM's --generation-config).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(path: Path) -> dict[str, Any]:
    """A model folder's generation_config.json sampling defaults ({} for a GGUF file or
    a folder without one)."""
    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return {}
    try:
        config = read_json_object(file)
    except ModelFileError as e:  # (it names the file)
        log.warning("ignoring it: %s", e)
        return {}
    out = {k: config[k] for k in GENERATION_DEFAULTS if isinstance(config.get(k), int | float)}
    if out:
        log.info("sampling defaults from %s: %s", file, out)
    return out


def _json(text: str, name: str, kind: type[list[Any]] | type[dict[str, Any]]) -> Any:
    """A JSON list or object from a request field ("" is an empty one)."""
    if not text:
        return kind()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AdmissionError(f"{name} is not valid JSON: {e}") from None
    except RecursionError:  # deeper than Python's stack: the request's fault, not ours
        raise AdmissionError(f"{name} is nested too deeply") from None
    if not isinstance(value, kind):
        raise AdmissionError(f"{name} must be a JSON {'list' if kind is list else 'object'}")
    return value


def _arguments(text: str, i: int) -> Any:
    """A tool call's arguments as an object when they are JSON, else the string as sent."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:
        raise AdmissionError(f"messages[{i}].tool_calls: arguments nested too deeply") from None


def chat_messages(chat: pb.ChatInput) -> list[dict[str, Any]]:
    """ChatInput's messages as chat templates take them: tool calls with their arguments
    as objects (as transformers' templates expect), tool results with their call id."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(chat.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls_json:
            calls = _json(m.tool_calls_json, f"messages[{i}].tool_calls_json", list)
            msg["tool_calls"] = template_tool_calls(calls, i)
        out.append(msg)
    return out


def template_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """Message i's tool calls as chat templates take them: a list, each with a
    function.name, arguments sent as JSON text given as an object (transformers'
    templates expect one). New dicts: the caller's are left as they were."""
    if not isinstance(calls, list):
        raise AdmissionError(f"messages[{i}].tool_calls must be a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise AdmissionError(f"messages[{i}].tool_calls: each needs function.name")
        if isinstance(fn.get("arguments"), str):
            fn = {**fn, "arguments": _arguments(fn["arguments"], i)}
        out.append({**c, "function": fn})
    return out
