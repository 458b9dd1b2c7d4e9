"""The two generate endpoints, as vLLM splits them (serving_completion / serving_chat):
one skeleton (model check, generate calls, a stream of SSE chunks or one collected
response) and a subclass per endpoint for what differs: the calls a body makes, the
shape of a chunk's choice and of the whole response.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import tool_calls
from gateway.bodies import beside_body
from gateway.errors import APIError
from gateway.generation import (
    FINISH,
    GRAMMAR_KINDS,
    Delta,
    StreamItem,
    chat_call,
    check_model,
    collect_calls,
    completion_calls,
    constraining_field,
    detokenize,
    is_batch,
    start_stream,
)
from gateway.multiplex import Calls
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.tool_calls import ToolStream
from hetero_common.accumulate import ChoiceResult, stop_reason
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


def sse(obj: dict[str, Any] | str) -> bytes:
    return (
        f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()
    )


def usage_json(u: pb.Usage, details: bool = False) -> dict[str, Any]:
    """OpenAI's usage object; prompt_tokens_details when the prefix cache hit, or always
    with `details` (a stream's usage objects all carry the same fields)."""
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    if u.cached_prompt_tokens or details:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return out


class TextOffsets:
    """Where each token starts in the text: the characters its bytes and those of the
    tokens before it complete. A token's text alone is no measure: a byte-fallback or
    byte-level piece of a character reads U+FFFD, one character per piece, where the text
    has one for the whole character ('𓀀' is 4 tokens of Gemma 3: offsets n, n, n, n, and
    the next token's n + 1)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode

    def take(self, lps: list[pb.TokenLogprob]) -> list[int]:
        """The offsets of these tokens, the next ones' counted on from them."""
        out = []
        for lp in lps:
            out.append(self.at)
            self.skip(lp.token_bytes)
        return out

    def skip(self, data: bytes) -> None:
        """Count on past these bytes of the text (a character they start stays pending)."""
        self.at += len(self._decode(data))


def completion_logprobs(
    lps: list[pb.TokenLogprob], offsets: TextOffsets, top: int | None = None
) -> dict[str, Any]:
    """`offsets`: where the text of `lps` starts (and what of a character is pending);
    `top`: at most this many alternatives per token (prompt logprobs come with as many
    as the larger of logprobs and prompt_logprobs)."""
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        # The sampled token's entry is always there (so logprobs: 0 gives it alone), as vLLM.
        "top_logprobs": [
            {lp.token: lp.logprob, **{t.token: t.logprob for t in lp.top_logprobs[:top]}}
            for lp in lps
        ],
        "text_offset": offsets.take(lps),
    }


def vllm_prompt_logprobs(
    lps: list[pb.TokenLogprob], top: int | None
) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token a dict of
    token id -> {logprob, rank, decoded_token}: the prompt token and the `top` most likely
    ones."""
    out: list[dict[str, Any] | None] = [None]
    for lp in lps:
        entry = {
            str(t.token_id): {"logprob": t.logprob, "rank": k + 1, "decoded_token": t.token}
            for k, t in enumerate(lp.top_logprobs[:top])
        }
        entry[str(lp.token_id)] = {
            "logprob": lp.logprob,
            "rank": lp.rank,
            "decoded_token": lp.token,
        }
        out.append(entry)
    return out


def echo_logprobs(
    text: str, first: str, lps: list[pb.TokenLogprob], top: int | None
) -> dict[str, Any]:
    """Completions' logprobs of an echoed prompt `text`: its first token has none (nothing
    precedes it), the others theirs (`top` alternatives), from offset 0. The offsets index
    the echoed text, as the generated tokens' do (they start at its end), counted on its
    bytes (TextOffsets): the first token's are what the others leave of the text, none
    when it is the BOS the tokenizer added, which the text lacks."""
    data = text.encode()
    offsets = TextOffsets()
    offsets.skip(data[: max(0, len(data) - sum(len(lp.token_bytes) for lp in lps))])
    body = completion_logprobs(lps, offsets, top)
    return {
        "tokens": [first, *body["tokens"]],
        "token_logprobs": [None, *body["token_logprobs"]],
        "top_logprobs": [None, *body["top_logprobs"]],
        "text_offset": [0, *body["text_offset"]],
    }


def join_logprobs(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    return b if a is None else {k: a[k] + b[k] for k in b}


def chat_logprobs(lps: list[pb.TokenLogprob]) -> dict[str, Any]:
    def one(t: Any) -> dict[str, Any]:  # a TokenLogprob or one of its top_logprobs
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}

    return {
        "content": [{**one(lp), "top_logprobs": [one(t) for t in lp.top_logprobs]} for lp in lps]
    }


@dataclass(frozen=True)
class PlaneSettings:
    """What the gateway reads once from a control plane's ModelInfo."""

    defaults: dict[str, Any]  # the model's generation_config.json sampling defaults
    max_waiting: int  # its waiting queue's size per compute plane (0: not said)


def check_batch(num_calls: int, max_waiting: int, param: str) -> None:
    """A batch's requests are admitted at once, so one of more prompts than a waiting
    queue holds is refused whatever the load (400, not a 429 a client would retry)."""
    if max_waiting and num_calls > max_waiting:
        raise APIError(
            400,
            f"a batch of {num_calls} prompts is more than the server queues at once "
            f"(--max-waiting {max_waiting}): send at most {max_waiting} per request",
            param=param,
        )


def apply_defaults(body: Any, defaults: dict[str, Any]) -> None:
    """The model's sampling defaults for the fields the request left out (vLLM's
    --generation-config auto)."""
    for name, value in defaults.items():
        if name not in body.model_fields_set and name in type(body).model_fields:
            field_type = type(getattr(body, name))
            setattr(body, name, field_type(value))


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (and so its gRPC calls) and
    raise APIError 499: the CancelledError that ended it, let out of the app, was logged
    as an "Exception in ASGI application" and counted as a 500."""
    task = asyncio.ensure_future(work)
    left = False

    async def watch() -> None:
        nonlocal left
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                left = True
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not left or (current is not None and current.cancelling()):
            raise  # cancelled from outside (the server stopping): not the client's doing
        # nginx's status for a client gone before its response: nobody reads it, but the
        # metrics and the trace count the request under it.
        raise APIError(
            499, "the client closed the connection", type="client_closed_request"
        ) from None
    finally:
        watcher.cancel()


async def aclose(iterator: Any) -> None:
    """Close an async generator now (runs its `finally`); anything else: nothing."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body when the response ends, however it ends.

    Starlette stops iterating the body when the client disconnects, but when the
    disconnect lands while a chunk is being sent the body generator stays suspended at
    its `yield`: its cleanup (cancelling the request's gRPC calls, so the control plane
    frees its blocks) would wait for the garbage collector or the server's shutdown,
    and the request would generate on to max_tokens for nobody."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await aclose(self.body_iterator)


@dataclass
class Call(Generic[Body]):
    """One HTTP request being served: its body, generate calls and response identity."""

    body: Body
    model: str
    calls: list[pb.GenerateRequest]
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, TextOffsets] = field(default_factory=dict)  # completions' logprobs
    tool_streams: dict[int, ToolStream] = field(default_factory=dict)  # chat with tools
    prompt_ids: list[list[int]] = field(default_factory=list)  # once every call is admitted
    echo: list[str] = field(default_factory=list)  # completions echo with logprobs, streamed
    first_tokens: list[str] = field(default_factory=list)  # each prompt's first token's text
    prompt_lps: dict[int, list[pb.TokenLogprob]] = field(default_factory=dict)  # by prompt
    echoed: set[int] = field(default_factory=set)
    shown_prompt: set[int] = field(default_factory=set)  # choices given prompt_token_ids
    shown_plps: set[int] = field(default_factory=set)  # choices given prompt_logprobs
    # return_token_ids, streamed: ids of deltas that gave no chunk (their text held back
    # while it may be a stop string), sent with the choice's next chunk
    unsent_ids: dict[int, list[int]] = field(default_factory=dict)
    num_generated: int = 0  # tokens streamed so far (continuous usage)


class Serving(Generic[Body]):
    """The skeleton of a generate endpoint; subclasses fill in the shapes."""

    id_prefix = ""
    chunk_object = ""
    input_param = ""  # the field that holds the input, named by a context-length error

    def __init__(
        self,
        model_name: Callable[[], Awaitable[str]],
        mux: Calls,
        stub: Callable[[], pb_grpc.ControlPlaneStub],
        timeout: float,
        settings: Callable[[], Awaitable[PlaneSettings]],
    ) -> None:
        """`settings`: the model's sampling defaults (generation_config.json), for the
        fields a request leaves out, and the size of a batch the planes take."""
        self.model_name, self.mux, self.stub, self.timeout = model_name, mux, stub, timeout
        self.settings = settings

    async def __call__(self, body: Body, request: Request) -> Response:
        try:
            return await self._serve(body, request)
        except APIError as e:
            if e.param is None and e.code == "context_length_exceeded":
                e.param = self.input_param  # (as OpenAI: the input is what does not fit)
            elif e.param is None and e.message.startswith(GRAMMAR_KINDS):
                e.param = constraining_field(body)  # the control plane's grammar compile
            if e.param == self.input_param and e.call_index is not None and self.batch(body):
                # One prompt of a batch was refused: which (as pydantic names prompt.3.0)
                e.param = f"{e.param}.{e.call_index}"
                e.message = f"{e.param}: {e.message.removeprefix(self.input_param + ': ')}"
            raise

    async def _serve(self, body: Body, request: Request) -> Response:
        model = await self.model_name()
        check_model(body.model, model)
        settings = await self.settings()
        apply_defaults(body, settings.defaults)
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )
        self.check(body)
        calls = await beside_body(request, self.calls, body)
        check_batch(len(calls), settings.max_waiting, self.input_param)
        call = Call(body, model, calls, f"{self.id_prefix}{uuid.uuid4().hex}")
        if body.stream:
            stream = await cancel_on_disconnect(
                request, start_stream(self.mux, call.calls, self.timeout)
            )
            return ClosingStreamingResponse(
                self.events(call, stream), media_type="text/event-stream"
            )
        return JSONResponse(await cancel_on_disconnect(request, self.collect(call)))

    # What a subclass provides.
    def check(self, body: Body) -> None:
        """Refuse a combination of fields the endpoint does not serve (APIError)."""

    def calls(self, body: Body) -> list[pb.GenerateRequest]:
        raise NotImplementedError

    def batch(self, body: Body) -> bool:
        """The input is a list of inputs, one call each (an error names the one at fault)."""
        return False

    async def head(self, call: Call[Body], prompt_ids: list[list[int]]) -> list[dict[str, Any]]:
        """Choices of the chunks before the deltas, one chunk each (once every call is
        admitted)."""
        return []

    def delta_choice(self, call: Call[Body], d: Delta) -> dict[str, Any]:
        raise NotImplementedError

    def delta_choices(self, call: Call[Body], d: Delta) -> list[dict[str, Any]]:
        """The chunks' choices a delta gives (none when it carries nothing to show)."""
        c = d.choice
        return [self.delta_choice(call, d)] if c.text or c.finish_reason or c.logprobs else []

    async def response(
        self,
        call: Call[Body],
        states: dict[int, ChoiceResult],
        usage: pb.Usage,
        prompts: list[list[int]],
    ) -> dict[str, Any]:
        raise NotImplementedError

    # The skeleton.
    def chunk(
        self,
        call: Call[Body],
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        """A chunk (or, with the whole choices and usage, a response); `first`: a choice's
        opening chunk (chat with return_token_ids gives the prompt's ids there)."""
        return {
            "id": call.id,
            "object": self.chunk_object,
            "created": call.created,
            "model": call.model,
            **self.chunk_extra,
            "choices": choices,
            "usage": usage,
        }

    chunk_extra: dict[str, Any] = {}  # noqa: RUF012 -- read-only

    async def events(
        self, call: Call[Body], stream: AsyncIterator[StreamItem]
    ) -> AsyncIterator[bytes]:
        body = call.body
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        # vLLM: usage on every chunk only when the final usage is asked for too.
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        # The chunks before the deltas (a chat's role chunks). With usage on every chunk
        # they wait for the first token, as vLLM sends them: the prefix cache's hit is
        # known only once the prompt is scheduled, and they would report 0 cached tokens
        # where the chunks after them report the hit.
        head: list[dict[str, Any]] = []
        try:
            async for deltas, usage, prompt_ids, cached in stream:
                if prompt_ids is not None:
                    call.prompt_ids = prompt_ids
                    head = await self.head(call, prompt_ids)
                if head and (not continuous or deltas or usage is not None):
                    for k, choice in enumerate(head):
                        live = self.live_usage(call, cached) if continuous else None
                        yield sse(self.chunk(call, [choice], live, first=k == 0))
                    head = []
                for d in deltas:
                    call.num_generated += len(d.choice.token_ids)
                    prompt = d.index // body.n
                    if d.choice.index == 0 and prompt not in call.prompt_lps:
                        # (the prompt's logprobs come on its choice 0's first delta; none
                        # when not asked for, or when the prompt is one token)
                        call.prompt_lps[prompt] = list(d.choice.prompt_logprobs)
                    choices = self.delta_choices(call, d)
                    if not choices and body.return_token_ids:
                        call.unsent_ids.setdefault(d.index, []).extend(d.choice.token_ids)
                    for k, choice in enumerate(choices):
                        self.add_token_ids(call, d, choice, first=k == 0)
                        live = self.live_usage(call, cached) if continuous else None
                        yield sse(self.chunk(call, [choice], live))
                if usage is not None and include_usage:
                    yield sse(self.chunk(call, [], usage_json(usage, details=continuous)))
        except APIError as e:
            yield sse(e.body())
        finally:  # closed early (the client left): the calls are cancelled now
            await aclose(stream)
        yield sse("[DONE]")

    def add_token_ids(
        self, call: Call[Body], d: Delta, choice: dict[str, Any], first: bool
    ) -> None:
        """return_token_ids: each delta's tokens, on the `first` of the chunks it gives
        (with those of deltas that gave none); a choice's first chunk, its prompt's.
        prompt_logprobs: on each choice's first chunk once its prompt's have come (on
        choice 0's first delta), as the whole response gives them to every choice."""
        top = call.body.prompt_logprobs
        if top is not None and d.index not in call.shown_plps:
            plps = call.prompt_lps.get(d.index // call.body.n)
            if plps is not None:
                call.shown_plps.add(d.index)
                choice["prompt_logprobs"] = vllm_prompt_logprobs(plps, top)
        if not call.body.return_token_ids:
            return
        ids = [*call.unsent_ids.pop(d.index, ()), *d.choice.token_ids] if first else []
        choice["token_ids"] = ids
        if d.index not in call.shown_prompt and call.prompt_ids:
            call.shown_prompt.add(d.index)
            choice["prompt_token_ids"] = call.prompt_ids[d.index // call.body.n]

    def live_usage(self, call: Call[Body], cached: int) -> dict[str, Any]:
        """Usage so far (stream_options.continuous_usage_stats), with the prompt tokens
        served from the prefix cache so far (known from a prompt's first token on)."""
        prompt = sum(len(p) for p in call.prompt_ids)
        usage = pb.Usage(
            prompt_tokens=prompt, completion_tokens=call.num_generated, cached_prompt_tokens=cached
        )
        return usage_json(usage, details=True)

    async def collect(self, call: Call[Body]) -> dict[str, Any]:
        states, usage, prompts = await collect_calls(self.mux, call.calls, self.timeout)
        return await self.response(call, states, usage, prompts)


class CompletionServing(Serving[CompletionRequest]):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"
    input_param = "prompt"

    def check(self, body: CompletionRequest) -> None:
        if body.max_tokens == 0 and not body.echo:  # (as vLLM: nothing to answer)
            raise APIError(
                400,
                "max_tokens must be at least 1 (0 only with echo: the prompt and its "
                "logprobs, nothing generated)",
                param="max_tokens",
            )

    def calls(self, body: CompletionRequest) -> list[pb.GenerateRequest]:
        return completion_calls(body)

    def batch(self, body: CompletionRequest) -> bool:
        return is_batch(body)

    async def prefixes(
        self, call: Call[CompletionRequest], prompt_ids: list[list[int]]
    ) -> list[str]:
        """With echo, each prompt's text (token-id prompts detokenised), else ""."""
        if not call.body.echo:
            return [""] * len(call.calls)
        out = []
        for c, ids in zip(call.calls, prompt_ids, strict=True):
            text = c.text if c.WhichOneof("input") == "text" else await detokenize(self.stub(), ids)
            out.append(text)
        return out

    async def head(
        self, call: Call[CompletionRequest], prompt_ids: list[list[int]]
    ) -> list[dict[str, Any]]:
        if not call.body.echo:
            return []
        echo, n = await self.prefixes(call, prompt_ids), call.body.n
        if call.body.logprobs is not None:
            # Sent with each choice's first delta, which brings the prompt's logprobs.
            call.echo = echo
            call.first_tokens = [await self.first_token(ids) for ids in prompt_ids]
            return []
        return [
            {"index": i * n + k, "text": echo[i], "logprobs": None, "finish_reason": None}
            for i in range(len(call.calls))
            for k in range(n)
        ]

    async def first_token(self, ids: list[int]) -> str:
        return await detokenize(self.stub(), ids[:1]) if ids else ""

    def delta_choice(self, call: Call[CompletionRequest], d: Delta) -> dict[str, Any]:
        c, lp = d.choice, None
        body = call.body
        text, head = c.text, None
        prompt = d.index // body.n
        if call.echo and d.index not in call.echoed:  # echo with logprobs, streamed
            call.echoed.add(d.index)
            text = call.echo[prompt] + text
            plps = call.prompt_lps.get(prompt, [])
            head = echo_logprobs(call.echo[prompt], call.first_tokens[prompt], plps, body.logprobs)
            call.offsets[d.index] = TextOffsets(len(call.echo[prompt]))
        if body.logprobs is not None:
            at = call.offsets.setdefault(d.index, TextOffsets())
            lp = join_logprobs(head, completion_logprobs(list(c.logprobs), at))
        reason = FINISH.get(c.finish_reason)
        return {
            "index": d.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": reason,
            "stop_reason": stop_reason(c) if c.finish_reason else None,
        }

    async def response(
        self,
        call: Call[CompletionRequest],
        states: dict[int, ChoiceResult],
        usage: pb.Usage,
        prompts: list[list[int]],
    ) -> dict[str, Any]:
        echo, body = await self.prefixes(call, prompts), call.body
        choices = []
        for idx in sorted(states):
            st, prefix = states[idx], echo[idx // body.n]
            plps = states[idx - idx % body.n].prompt_logprobs  # choice 0 of its prompt
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(st.logprobs, TextOffsets(len(prefix)))
                if body.echo:
                    first = await self.first_token(prompts[idx // body.n])
                    lp = join_logprobs(echo_logprobs(prefix, first, plps, body.logprobs), lp)
            reason = FINISH.get(st.finish_reason)
            want_ids, want_plps = body.return_token_ids, body.prompt_logprobs is not None
            choice = {
                "index": idx,
                "text": prefix + st.text,
                "logprobs": lp,
                "finish_reason": reason,
                "stop_reason": st.stop_reason,
                # vLLM's extensions, null unless asked for
                "prompt_logprobs": (
                    vllm_prompt_logprobs(plps, body.prompt_logprobs) if want_plps else None
                ),
                "prompt_token_ids": prompts[idx // body.n] if want_ids else None,
                "token_ids": st.token_ids if want_ids else None,
            }
            choices.append(choice)
        return self.chunk(call, choices, usage_json(usage))


class ChatServing(Serving[ChatCompletionRequest]):
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    input_param = "messages"
    chunk_extra = {"system_fingerprint": None}  # noqa: RUF012 -- read-only

    def calls(self, body: ChatCompletionRequest) -> list[pb.GenerateRequest]:
        return [chat_call(body)]

    async def head(
        self, call: Call[ChatCompletionRequest], prompt_ids: list[list[int]]
    ) -> list[dict[str, Any]]:
        first = {"role": "assistant", "content": self.echo(call.body)}
        call.shown_prompt.update(range(call.body.n))  # the first chunk has them at the top
        return [
            {"index": i, "delta": first, "logprobs": None, "finish_reason": None}
            for i in range(call.body.n)
        ]

    def chunk(
        self,
        call: Call[ChatCompletionRequest],
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        out = super().chunk(call, choices, usage)
        if first and call.body.return_token_ids and call.prompt_ids:
            out["prompt_token_ids"] = call.prompt_ids[0]  # at the top, as vLLM streams it
        return out

    def delta_choice(self, call: Call[ChatCompletionRequest], d: Delta) -> dict[str, Any]:
        c = d.choice
        lp = chat_logprobs(list(c.logprobs)) if call.body.logprobs else None
        delta = {"content": c.text} if c.text else {}
        return {
            "index": d.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": FINISH.get(c.finish_reason),
            "stop_reason": stop_reason(c) if c.finish_reason else None,
        }

    def delta_choices(self, call: Call[ChatCompletionRequest], d: Delta) -> list[dict[str, Any]]:
        """With tools: content until it may be a tool call, then the parsed calls, one
        `tool_calls` delta each (whole arguments), when the choice ends."""
        body = call.body
        if not tool_calls.active(body):
            return super().delta_choices(call, d)
        c = d.choice
        st = call.tool_streams.get(d.index)
        if st is None:
            st = call.tool_streams[d.index] = ToolStream(
                {t.function.name for t in body.tools or ()},
                body.parallel_tool_calls,
                forced=tool_calls.forced(body) is not None,
            )
        out: list[dict[str, Any]] = []
        text = st.feed(c.text)
        if c.finish_reason:
            text += st.finish(cut=tool_calls.cut_short(c.finish_reason, stop_reason(c)))
        lp = chat_logprobs(list(c.logprobs)) if body.logprobs and c.logprobs else None

        def chunk(delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
            keys = {"logprobs": None, "finish_reason": None, "stop_reason": None}
            return {"index": d.index, "delta": delta, **keys, **fields}

        if text or lp:
            out.append(chunk({"content": text} if text else {}, logprobs=lp))
        if c.finish_reason:
            for i, tc in enumerate(st.calls):
                out.append(chunk({"tool_calls": [{"index": i, **tc}]}))  # whole arguments
            reason = FINISH.get(c.finish_reason)
            if st.calls and not st.cut and reason == "stop":
                reason = "tool_calls"
            out.append(chunk({}, finish_reason=reason, stop_reason=stop_reason(c)))
        return out

    @staticmethod
    def echo(body: ChatCompletionRequest) -> str:
        """With echo, the last message's text when it is the assistant's (continued)."""
        last = body.messages[-1]
        return last.text() if body.echo and last.role == "assistant" else ""

    async def response(
        self,
        call: Call[ChatCompletionRequest],
        states: dict[int, ChoiceResult],
        usage: pb.Usage,
        prompts: list[list[int]],
    ) -> dict[str, Any]:
        body = call.body
        echo = self.echo(body)
        names = {t.function.name for t in body.tools or ()} if tool_calls.active(body) else None
        choices = []
        for i in sorted(states):
            st = states[i]
            message: dict[str, Any] = {"role": "assistant", "content": echo + st.text}
            reason = FINISH.get(st.finish_reason)
            if names is not None:
                parallel, forced = body.parallel_tool_calls, tool_calls.forced(body) is not None
                content, calls = tool_calls.parse(st.text, names, parallel)
                cut = tool_calls.cut_short(st.finish_reason, st.stop_reason)
                if calls:
                    if content is None and forced:
                        content = ""  # a forced call has no text (vLLM answers "")
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
                elif forced:  # cut short (max_tokens): what it got to, no markup as content
                    message = {"role": "assistant", "content": ""}
                    if cut_calls := tool_calls.cut_calls(st.text, names, parallel):
                        message["tool_calls"] = cut_calls
                elif cut and (found := tool_calls.cut_auto(st.text, names, parallel)):
                    content, calls = found  # (the same rule, auto: the text before the call)
                    message = {"role": "assistant", "content": content}
                    if calls:
                        message["tool_calls"] = calls
            choice = {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(st.logprobs) if body.logprobs else None,
                "finish_reason": reason,
                "stop_reason": st.stop_reason,
                "token_ids": st.token_ids if body.return_token_ids else None,
            }
            choices.append(choice)
        out = self.chunk(call, choices, usage_json(usage))
        out["object"] = "chat.completion"
        out["prompt_token_ids"] = prompts[0] if body.return_token_ids else None
        out["prompt_logprobs"] = (
            vllm_prompt_logprobs(states[0].prompt_logprobs, body.prompt_logprobs)
            if body.prompt_logprobs is not None
            else None
        )
        return out
