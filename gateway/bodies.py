"""The generate routes' JSON bodies, validated off the event loop when they are big.

FastAPI validates a route's body model on the event loop. A 2 MiB chat of 50,000
one-letter messages took 0.4-1 s there, and every stream the gateway serves stood still
meanwhile (four such requests at once: a 3-4 s gap in the other streams' tokens). So
/v1/completions and /v1/chat/completions read their body themselves: a small one (most
are) is validated on the loop, a big one in a lane of half the CPUs. pydantic holds the
GIL while it works, but the loop takes its turn every few milliseconds instead of
waiting for the whole body; the generate calls built from a big body are built there
too (`beside_body`). The errors are FastAPI's own (RequestValidationError, with
the same locations and types), and the OpenAPI schema still shows each body (`document`).
"""

from __future__ import annotations

import asyncio
import email.message
import functools
import json
import re
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from hetero_common.cpus import side_lane

M = TypeVar("M", bound=BaseModel)
P = ParamSpec("P")
R = TypeVar("R")
# Bodies up to this size are validated on the event loop (a few milliseconds at most).
OFF_LOOP_BYTES = 64 << 10
_LANE = side_lane("body")


async def read_body(request: Request, model: type[M]) -> M:
    """The request's body as `model`; RequestValidationError as FastAPI raises it."""
    raw, kind = await request.body(), request.headers.get("content-type")
    if len(raw) <= OFF_LOOP_BYTES:
        return _parse(raw, kind, model)
    return await asyncio.get_running_loop().run_in_executor(_LANE, _parse, raw, kind, model)


async def beside_body(request: Request, fn: Callable[P, R], *args: P.args, **kw: P.kwargs) -> R:
    """fn(*args, **kw) where read_body validated this request's body: in the lane for a
    big one. For the work that grows with the body after it is read (its generate calls:
    a 50,000-message chat's protobuf took 0.07-0.1 s, which held every stream)."""
    if len(await request.body()) <= OFF_LOOP_BYTES:  # (starlette keeps the body read)
        return fn(*args, **kw)
    return await asyncio.get_running_loop().run_in_executor(
        _LANE, functools.partial(fn, *args, **kw)
    )


def _parse(raw: bytes, content_type: str | None, model: type[M]) -> M:
    """As FastAPI reads a body: JSON when the content type says so, the bytes themselves
    otherwise (which no model takes: the error says what came)."""
    if not raw:
        error = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([error])
    value: Any = raw
    if _is_json(content_type):
        try:
            value = loads(raw)
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as e:
            raise _not_json(e) from None
    try:  # (from_attributes: what FastAPI's own validation says of a value of no fields)
        return model.model_validate(value, from_attributes=True)
    except ValidationError as e:
        errors = [{**x, "loc": ("body", *x["loc"])} for x in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


# A JSON string, or (group 1) a literal Python's json reads that JSON has not.
_STRING_OR_CONSTANT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


def loads(text: str | bytes) -> Any:
    """JSON as the standard has it: json.loads, but NaN, Infinity and -Infinity (which
    Python reads, and which then reached the control plane as null) are a
    json.JSONDecodeError at the literal, as any other invalid value."""
    return json.loads(text, parse_constant=functools.partial(_no_constant, text))


def _no_constant(text: str | bytes, literal: str) -> Any:
    if isinstance(text, bytes):  # (as json.loads decodes it)
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    # The document parsed up to here: the first such literal outside a string is it.
    pos = next((m.start(1) for m in _STRING_OR_CONSTANT.finditer(text) if m.group(1)), 0)
    raise json.JSONDecodeError(f"{literal} is not a JSON value", text, pos)


class StrictJSONRequest(Request):
    """A request whose JSON body is read by `loads` (FastAPI reads a route's body model
    through `Request.json`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route that reads its JSON body with `loads` (FastAPI's route class pattern)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


def _not_json(e: Exception) -> RequestValidationError:
    pos, why = 0, "nested too deeply" if isinstance(e, RecursionError) else "not UTF-8 text"
    if isinstance(e, json.JSONDecodeError):
        pos, why = e.pos, e.msg
    error = {"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error"}
    return RequestValidationError([{**error, "input": {}, "ctx": {"error": why}}])


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False  # (FastAPI's strict default: no type, not JSON)
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its body is `model` (see `document`)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def document(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Put `models` (the bodies the routes read themselves) into the app's OpenAPI
    components, where `body_schema` points."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                one = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(one.pop("$defs", {}))
                components[model.__name__] = one
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
