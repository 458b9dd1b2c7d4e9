"""FastAPI app: the OpenAI HTTP API in front of the control plane's gRPC API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.auth import require_api_key
from gateway.body_limit import BodyLimit
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.generation import (
    FINISH,
    chat_call,
    check_model,
    collect_calls,
    completion_calls,
    detokenize,
    start_stream,
)
from gateway.metrics import instrument
from gateway.multiplex import Multiplexer
from gateway.request_id import RequestIdMiddleware
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc


class ControlLink:
    """The gRPC channel to the control plane, and the served model's name."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.ControlPlaneStub | None = None
        self.mux = Multiplexer(self.open)  # every generate call goes over its one stream
        self._model: str | None = config.served_model_name
        tls = config.control_tls
        # Read the certificates now: a bad path stops the gateway at start-up.
        self._credentials = tls.credentials() if tls.enabled else None

    def open(self) -> pb_grpc.ControlPlaneStub:
        if self.stub is None:
            # One GenerateMany message holds a step's output for every request, and the
            # admission of many long prompts at once: past gRPC's 4 MB default it would
            # end the call, and every request on it.
            options = [("grpc.max_receive_message_length", -1)]
            if self._credentials is None:
                self.channel = grpc.aio.insecure_channel(self.config.control, options=options)
            else:
                self.channel = grpc.aio.secure_channel(
                    self.config.control, self._credentials, options=options
                )
            self.stub = pb_grpc.ControlPlaneStub(self.channel)
        return self.stub

    async def info(self, timeout: float = 2.0) -> pb.ModelInfoResponse:
        try:
            return await self.open().ModelInfo(pb.ModelInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise APIError(
                503, f"control plane unavailable: {e.code().name}", type="service_unavailable"
            ) from e

    async def model_name(self) -> str:
        if self._model is None:
            self._model = (await self.info()).model_name
        return self._model


def _union_tag(loc: object) -> bool:
    """pydantic names the union member in an error's loc ('str', 'list[int]'); not a param."""
    return isinstance(loc, str) and (loc in ("str", "int", "float", "bool") or "[" in loc)


def _sse(obj: dict[str, Any] | str) -> bytes:
    return (
        f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()
    )


def _usage(u: pb.Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    if u.cached_prompt_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return out


def _completion_logprobs(lps: list[pb.TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        tokens.append(lp.token)
        offset += len(lp.token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(lps: list[pb.TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token_bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}
                    for t in lp.top_logprobs
                ],
            }
            for lp in lps
        ]
    }


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (and so its gRPC calls)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()


def create_app(config: GatewayConfig) -> FastAPI:
    app = FastAPI(title="hetero-paged-infer", version="0.1.0", description="OpenAI-compatible API")
    link = ControlLink(config)
    app.state.link = link
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key:
        require_api_key(app, config.api_key)
    instrument(app)  # added after the others, so outside them: 401s are counted too
    app.add_middleware(RequestIdMiddleware)  # outermost: every response has an id

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _union_tag(x)]
        param = ".".join(loc) or None
        message = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        return APIError(400, f"{param}: {message}" if param else message, param=param).response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the gateway process answers."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the control plane answers and has a compute plane attached."""
        try:
            info = await link.info(timeout=1.0)
        except APIError as e:
            return JSONResponse({"status": "unavailable", "reason": e.message}, status_code=503)
        if not info.compute_attached:
            return JSONResponse(
                {"status": "unavailable", "reason": "no compute plane attached"}, status_code=503
            )
        return JSONResponse({"status": "ready", "model": info.model_name})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = await link.model_name()
        info = await link.info()
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "hetero-paged-infer",
                    "max_model_len": info.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = await link.model_name()
        check_model(body.model, model)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported", param="echo")
        stub = link.open()
        calls = completion_calls(body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        async def prefixes(prompt_ids: list[list[int]]) -> list[str]:
            if not body.echo:
                return [""] * len(calls)
            out = []
            for call, ids in zip(calls, prompt_ids, strict=True):
                out.append(
                    call.text if call.WhichOneof("input") == "text" else await detokenize(stub, ids)
                )
            return out

        def chunk(
            choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage,
            }

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            stream = await _cancel_on_disconnect(
                request, start_stream(link.mux, calls, config.request_timeout)
            )

            async def events() -> AsyncIterator[bytes]:
                echo: list[str] = []
                offsets: dict[int, int] = {}
                try:
                    async for deltas, usage, prompt_ids in stream:
                        if prompt_ids is not None and body.echo:
                            echo = await prefixes(prompt_ids)
                            yield _sse(
                                chunk(
                                    [
                                        {
                                            "index": i * body.n + k,
                                            "text": echo[i],
                                            "logprobs": None,
                                            "finish_reason": None,
                                        }
                                        for i in range(len(calls))
                                        for k in range(body.n)
                                    ]
                                )
                            )
                        for d in deltas:
                            c = d.choice
                            if not (c.text or c.finish_reason or c.logprobs):
                                continue
                            lp = None
                            if body.logprobs is not None:
                                lp = _completion_logprobs(list(c.logprobs), offsets.get(d.index, 0))
                                offsets[d.index] = offsets.get(d.index, 0) + sum(
                                    len(x.token) for x in c.logprobs
                                )
                            reason = FINISH.get(c.finish_reason)
                            yield _sse(
                                chunk(
                                    [
                                        {
                                            "index": d.index,
                                            "text": c.text,
                                            "logprobs": lp,
                                            "finish_reason": reason,
                                        }
                                    ]
                                )
                            )
                        if usage is not None and include_usage:
                            yield _sse(chunk([], _usage(usage)))
                except APIError as e:
                    yield _sse(e.body())
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect() -> dict[str, Any]:
            states, usage, prompt_ids = await collect_calls(link.mux, calls, config.request_timeout)
            echo = await prefixes(prompt_ids)
            choices = []
            for idx in sorted(states):
                st = states[idx]
                prefix = echo[idx // body.n]
                lp = (
                    _completion_logprobs(st.logprobs, len(prefix))
                    if body.logprobs is not None
                    else None
                )
                choices.append(
                    {
                        "index": idx,
                        "text": prefix + st.text,
                        "logprobs": lp,
                        "finish_reason": FINISH.get(st.finish_reason),
                    }
                )
            return chunk(choices, _usage(usage))

        return JSONResponse(await _cancel_on_disconnect(request, collect()))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = await link.model_name()
        check_model(body.model, model)
        calls = [chat_call(body)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(
            choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": None,
                "choices": choices,
                "usage": usage,
            }

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = await _cancel_on_disconnect(
                request, start_stream(link.mux, calls, config.request_timeout)
            )

            async def events() -> AsyncIterator[bytes]:
                yield _sse(
                    chunk(
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            for i in range(body.n)
                        ]
                    )
                )
                try:
                    async for deltas, usage, _ in stream:
                        for d in deltas:
                            c = d.choice
                            if not (c.text or c.finish_reason or c.logprobs):
                                continue
                            lp = _chat_logprobs(list(c.logprobs)) if body.logprobs else None
                            delta = {"content": c.text} if c.text else {}
                            reason = FINISH.get(c.finish_reason)
                            yield _sse(
                                chunk(
                                    [
                                        {
                                            "index": d.index,
                                            "delta": delta,
                                            "logprobs": lp,
                                            "finish_reason": reason,
                                        }
                                    ]
                                )
                            )
                        if usage is not None and include_usage:
                            yield _sse(chunk([], _usage(usage)))
                except APIError as e:
                    yield _sse(e.body())
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect() -> dict[str, Any]:
            states, usage, _ = await collect_calls(link.mux, calls, config.request_timeout)
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "system_fingerprint": None,
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": states[i].text},
                        "logprobs": _chat_logprobs(states[i].logprobs) if body.logprobs else None,
                        "finish_reason": FINISH.get(states[i].finish_reason),
                    }
                    for i in sorted(states)
                ],
                "usage": _usage(usage),
            }

        return JSONResponse(await _cancel_on_disconnect(request, collect()))

    @app.on_event("shutdown")
    async def _close() -> None:
        await link.mux.close()
        if link.channel is not None:
            await link.channel.close()

    return app


async def serve(config: GatewayConfig) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown (exit status 143); a
        gateway that drained cleanly exits 0, like the gRPC planes."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal)
            yield

        def _on_signal(self) -> None:
            self.force_exit = self.should_exit  # a second signal stops at once
            self.should_exit = True

    server = Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level="info",
            log_config=None,  # uvicorn's loggers go through the process's handler (--log-format)
            lifespan="on",
            # SIGTERM: stop accepting connections, finish in-flight requests (streams too).
            timeout_graceful_shutdown=math.ceil(config.drain_timeout),
        )
    )
    await server.serve()
