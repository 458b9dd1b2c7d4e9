"""The generate routes' bodies: a big one is validated in a worker thread, not on the
event loop (where it held every stream), with FastAPI's errors either way."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, field_validator
from starlette.requests import Request

from gateway.bodies import OFF_LOOP_BYTES, read_body

seen: list[str] = []


class Probe(BaseModel):
    text: str
    n: int = 0

    @field_validator("text")
    @classmethod
    def _where(cls, v: str) -> str:
        seen.append(threading.current_thread().name)
        return v


def _request(body: bytes, content_type: str = "application/json") -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-type", content_type.encode())]
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def _read(body: bytes, content_type: str = "application/json") -> tuple[Probe, str]:
    async def go() -> tuple[Probe, str]:
        return await read_body(_request(body, content_type), Probe), threading.current_thread().name

    seen.clear()
    return asyncio.run(go())


def test_a_small_body_is_read_on_the_loop_a_big_one_in_the_lane() -> None:
    small, loop = _read(b'{"text": "hi"}')
    assert small.text == "hi"
    assert seen == [loop]
    text = "x" * (OFF_LOOP_BYTES + 1)
    big, loop = _read(json.dumps({"text": text}).encode())
    assert big.text == text
    assert len(seen) == 1 and seen[0].startswith("body") and seen[0] != loop


@pytest.mark.parametrize("pad", [0, OFF_LOOP_BYTES], ids=["small", "big"])
def test_errors_are_fastapis_on_either_path(pad: int) -> None:
    body = json.dumps({"text": "x" * pad, "n": "many"}).encode()
    with pytest.raises(RequestValidationError) as e:
        _read(body)
    [error] = e.value.errors()
    assert (error["loc"], error["type"]) == (("body", "n"), "int_parsing")
    with pytest.raises(RequestValidationError) as e:
        _read(b"[" * 100_000 + b"]" * 100_000)  # deeper than Python's parser goes
    [error] = e.value.errors()
    assert (error["type"], error["ctx"]) == ("json_invalid", {"error": "nested too deeply"})
    with pytest.raises(RequestValidationError) as e:
        _read(b"text=hi", "application/x-www-form-urlencoded")  # not read as JSON
    [error] = e.value.errors()
    assert (error["loc"], error["type"]) == (("body",), "model_attributes_type")
