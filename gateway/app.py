"""FastAPI app: the OpenAI HTTP API in front of the control plane's gRPC API."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import math
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from gateway.auth import require_api_key
from gateway.bodies import StrictJSONRoute, body_schema, document, read_body
from gateway.body_limit import BodyLimit
from gateway.config import GatewayConfig
from gateway.control_planes import ControlPlanes
from gateway.errors import APIError, InternalErrors, from_grpc, http_error
from gateway.generation import chat_call, check_model, detokenize
from gateway.metrics import instrument
from gateway.request_id import RequestIdMiddleware
from gateway.router import Router
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from gateway.serving import ChatServing, CompletionServing, PlaneSettings
from gateway.slow_clients import guarded_h11
from gateway.tracing import TracingMiddleware
from hetero_common.tracing import tracing_enabled
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc


class ControlLink:
    """The control planes behind the gateway, the router that runs generate calls on
    them, and the served model's name."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.planes = ControlPlanes(config)
        self.mux = Router(self.planes, config.control_retry_timeout)
        self._model: str | None = config.served_model_name
        self._settings: PlaneSettings | None = None
        if config.control_tls.enabled:  # read the certificates now: a bad path stops start-up
            config.control_tls.credentials()

    async def start(self) -> None:
        await self.planes.start()

    def open(self) -> pb_grpc.ControlPlaneStub:
        """A stub of a control plane that is up (for the unary calls)."""
        return self.planes.stub()

    async def info(self, timeout: float = 2.0) -> pb.ModelInfoResponse:
        """ModelInfo of a control plane with a compute plane attached, if any; else of
        one that answers; APIError 503 when none answers."""
        return await self.planes.info(timeout)

    async def close(self) -> None:
        await self.planes.close()

    async def settings(self) -> PlaneSettings:
        """The model's generation_config.json sampling defaults and the planes' waiting
        queue size (fetched once)."""
        if self._settings is None:
            info = await self.info()
            defaults = json.loads(info.generation_defaults_json or "{}")
            self._settings = PlaneSettings(defaults, info.max_waiting)
        return self._settings

    async def model_name(self) -> str:
        if self._model is None:
            self._model = (await self.info()).model_name
        return self._model


def _union_tag(loc: object) -> bool:
    """pydantic names the union member in an error's loc ('str', 'list[int]'); not a param."""
    if isinstance(loc, str) and loc[:1].isupper() and loc.isidentifier():
        return True  # a union of models names the member (TokenizeChatRequest)
    return isinstance(loc, str) and (loc in ("str", "int", "float", "bool") or "[" in loc)


# The read routes answer HEAD as GET does (HTTP's rule; probes and load balancers use it).
READ = ["GET", "HEAD"]


def create_app(config: GatewayConfig, link: ControlLink | None = None) -> FastAPI:
    """The OpenAI API app; `link` (default: a gRPC ControlLink) is where requests go."""
    link = link or ControlLink(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await link.start()
        yield
        await link.close()

    app = FastAPI(
        title="hetero-paged-infer",
        version="0.1.0",
        description="OpenAI-compatible API",
        lifespan=lifespan,
    )
    app.router.route_class = StrictJSONRoute  # (no NaN: before any route is added)
    app.state.link = link
    app.add_middleware(InternalErrors)  # first, so innermost: inside the metrics and the id
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout=config.body_timeout)
    if config.api_key:
        require_api_key(app, config.api_key)
    instrument(app)  # added after the others, so outside them: 401s are counted too
    if tracing_enabled():
        app.add_middleware(TracingMiddleware)
    app.add_middleware(RequestIdMiddleware)  # outermost: every response has an id
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.api_route("/health", methods=READ)(_health)
    app.api_route("/ready", methods=READ)(functools.partial(_ready, link))
    app.api_route("/v1/models", methods=READ)(functools.partial(_models, link))
    app.api_route("/v1/models/{model_id:path}", methods=READ)(functools.partial(_model, link))
    args = (link.model_name, link.mux, link.open, config.request_timeout, link.settings)
    for path, serving, model in (
        ("/v1/completions", CompletionServing(*args), CompletionRequest),
        ("/v1/chat/completions", ChatServing(*args), ChatCompletionRequest),
    ):
        route = app.post(path, response_model=None, openapi_extra=body_schema(model))
        route(_endpoint(serving))
    document(app, [CompletionRequest, ChatCompletionRequest])
    app.post("/tokenize")(functools.partial(_tokenize, link))
    app.post("/detokenize")(functools.partial(_detokenize, link))
    app.api_route("/version", methods=READ)(_version)
    return app


async def _tokenize(link: ControlLink, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    if body.model is not None:
        check_model(body.model, await link.model_name())
    if isinstance(body, TokenizeChatRequest):
        fake = ChatCompletionRequest.model_validate(
            {
                "model": "",
                "messages": [m.model_dump(exclude_none=True) for m in body.messages],
                "add_generation_prompt": body.add_generation_prompt,
                "continue_final_message": body.continue_final_message,
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()] or None,
                "chat_template_kwargs": body.chat_template_kwargs,
            }
        )
        req = pb.TokenizeRequest(
            chat=chat_call(fake).chat, add_special_tokens=body.add_special_tokens
        )
    else:
        req = pb.TokenizeRequest(text=body.prompt, add_special_tokens=body.add_special_tokens)
    try:
        resp = await link.open().Tokenize(req, timeout=30)
    except grpc.aio.AioRpcError as e:
        error = from_grpc(e)
        if error.param is None and error.code == "context_length_exceeded":
            # (as the generate routes name it: the input is what does not fit)
            error.param = "messages" if req.HasField("chat") else "prompt"
        raise error from e
    return {
        "count": resp.count,
        "max_model_len": resp.max_model_len or None,  # (null: no compute plane yet)
        "tokens": list(resp.token_ids),
        "token_strs": None,
    }


async def _detokenize(link: ControlLink, body: DetokenizeRequest) -> dict[str, Any]:
    if body.model is not None:
        check_model(body.model, await link.model_name())
    try:
        return {"prompt": await detokenize(link.open(), body.tokens)}
    except APIError as e:
        if e.status == 400:  # (ids out of the vocabulary: the control plane says which)
            e.param = "tokens"
        raise


async def _version() -> dict[str, str]:
    return {"version": importlib.metadata.version("hetero-paged-infer")}


def _endpoint(serving: CompletionServing | ChatServing) -> Any:
    """The route function of a generate endpoint: it reads its own body (`read_body`:
    a big one is validated off the event loop)."""
    if isinstance(serving, CompletionServing):

        async def completions(request: Request) -> Response:
            return await serving(await read_body(request, CompletionRequest), request)

        return completions

    async def chat_completions(request: Request) -> Response:
        return await serving(await read_body(request, ChatCompletionRequest), request)

    return chat_completions


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
    detail = e.detail if isinstance(e.detail, str) else "invalid request"
    response = http_error(e.status_code, detail).response()
    if e.headers:  # 405's Allow
        response.headers.update(e.headers)
    return response


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = list(e.errors())
    # A union reports each member's complaint. The member that got furthest into the
    # value (the longest loc: tool_choice's object form down to function.name) says most;
    # on a tie, a complaint about a value the client sent beats one about a field it did
    # not (missing, or extra to that member), and a value's own (a bad item, a range)
    # beats "should be a valid string" from a member of another type.
    err = max(
        errors,
        key=lambda x: (
            len(x.get("loc", ())),
            x.get("type") not in ("missing", "extra_forbidden"),
            not str(x.get("type", "")).endswith("_type"),
        ),
    )
    if err.get("type") == "json_invalid":  # its loc is a byte offset, not a field
        reason = (err.get("ctx") or {}).get("error", "")
        pos = err["loc"][-1]
        if isinstance(pos, int) and pos > 0:  # (0: not where; too deep, not UTF-8)
            reason += f" (char {pos})"
        return APIError(400, f"the body is not valid JSON: {reason}".rstrip(": ")).response()
    if tuple(err.get("loc", ())) == ("body",) and err.get("type") == "model_attributes_type":
        # Not an object: JSON of another shape, or a body that was not read as JSON at
        # all (`curl -d` sends it as a form).
        message = "the body must be a JSON object"
        kind = request.headers.get("content-type", "")
        if "json" not in kind:
            message += f", sent with Content-Type: application/json (not {kind or 'none'})"
        return APIError(400, message).response()
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _union_tag(x)]
    param = ".".join(loc) or None
    message = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param=param).response()


async def _health() -> dict[str, str]:
    """Liveness: the gateway process answers."""
    return {"status": "ok"}


async def _ready(link: ControlLink) -> JSONResponse:
    """Readiness: a control plane answers and has a compute plane attached."""
    try:
        info = await link.info(timeout=1.0)
    except APIError as e:
        return JSONResponse({"status": "unavailable", "reason": e.message}, status_code=503)
    if not info.compute_attached:
        return JSONResponse(
            {"status": "unavailable", "reason": "no compute plane attached, or draining"},
            status_code=503,
        )
    return JSONResponse({"status": "ready", "model": info.model_name})


async def _models(link: ControlLink) -> dict[str, Any]:
    return {"object": "list", "data": [await _model_object(link)]}


async def _model(link: ControlLink, model_id: str) -> dict[str, Any]:
    """GET /v1/models/{id} (the openai client's models.retrieve): the served model, or
    404 model_not_found."""
    model = await _model_object(link)
    check_model(model_id, model["id"])
    return model


# When this gateway began serving the model: /v1/models' `created` (a Unix time, as
# vLLM's; 0 read as 1970 in clients that show it).
STARTED = int(time.time())


async def _model_object(link: ControlLink) -> dict[str, Any]:
    name = await link.model_name()
    info = await link.info()
    return {
        "id": name,
        "object": "model",
        "created": STARTED,
        "owned_by": "hetero-paged-infer",
        # null while no compute plane is attached: the context is the compute plane's
        # (0 read as a limit by a client that budgets max_tokens from it)
        "max_model_len": info.max_model_len or None,
    }


async def serve(config: GatewayConfig) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown (exit status 143); a
        gateway that drained cleanly exits 0, like the gRPC planes."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
            yield

        def _on_signal(self, sig: signal.Signals) -> None:
            # A second Ctrl-C stops at once (as uvicorn's own handler); a SIGTERM after
            # a signal does not: under `serve` a Ctrl-C reaches the whole process group
            # and serve then sends its own SIGTERM, which cut every stream off mid-answer.
            self.force_exit = self.force_exit or (self.should_exit and sig == signal.SIGINT)
            self.should_exit = True

    server = Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            # uvicorn's loggers go through the process's handler (--log-format) at the
            # process's level (--log-level): a level here would be set on them, overriding it
            log_level=None,
            log_config=None,
            http=guarded_h11(config.header_timeout, config.max_idle_connections_per_ip),
            lifespan="on",
            # SIGTERM: stop accepting connections, finish in-flight requests (streams too).
            timeout_graceful_shutdown=math.ceil(config.drain_timeout),
        )
    )
    await server.serve()
