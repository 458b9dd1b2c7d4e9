"""Fakes of the gateway's control link for the gateway's unit tests (a fake is fine there:
the unit under test is the gateway): FakeLink, whose FakeMux answers each generate call
with a scripted stream, and FakeStub its unary calls."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.errors import APIError
from gateway.serving import PlaneSettings
from hetero_proto import control_pb2 as pb

MODEL = "tiny-model"
PROMPT_IDS = [11, 12, 13]


def prompt_logprobs(top: int, prompt_ids: list[int] = PROMPT_IDS) -> list[pb.TokenLogprob]:
    """Prompt tokens 1.. with `top` alternatives each, none of them the token itself."""
    return [
        pb.TokenLogprob(
            token_id=t,
            token=f"p{t}",
            token_bytes=f"p{t}".encode(),
            logprob=-3.0,
            rank=top + 1,
            top_logprobs=[
                pb.TopLogprob(token_id=200 + j, token=f"a{j}", logprob=-0.5 - j) for j in range(top)
            ],
        )
        for t in prompt_ids[1:]
    ]


class FakeMux:
    """Answers each generate call with a scripted stream: admitted, then `pieces` as
    deltas of every choice (the first with the prompt's logprobs when asked), then the
    usage; or fails it with `error`, or call i alone with `call_errors[i]`; or, with
    `hold`, admits it and then sends nothing (a generation still under way)."""

    def __init__(self) -> None:
        self.pieces = ["Hel", "lo", "!"]
        self.piece_bytes: list[bytes] | None = None  # each piece's token's bytes if not its text
        self.error: APIError | None = None
        self.call_errors: dict[int, APIError] = {}
        self.hold = False
        self.prompt_ids = PROMPT_IDS
        self.calls: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []

    def start(
        self, calls: list[pb.GenerateRequest], queue: asyncio.Queue, timeout: float
    ) -> list[str]:  # type: ignore[type-arg]
        self.calls += calls
        for i, call in enumerate(calls):
            if self.error is not None:
                queue.put_nowait(self.error)
                continue
            if i in self.call_errors:
                queue.put_nowait((i, self.call_errors[i]))
                continue
            n = call.params.n or 1
            queue.put_nowait((i, pb.GenerateResponse(prompt_token_ids=self.prompt_ids)))
            if self.hold:
                continue
            for k, text in enumerate(self.pieces):
                last = k == len(self.pieces) - 1
                resp = pb.GenerateResponse()
                for c in range(n):
                    d = resp.choices.add(index=c, text=text, token_ids=[100 + k])
                    if call.params.logprobs:
                        data = text.encode() if self.piece_bytes is None else self.piece_bytes[k]
                        token = data.decode(errors="replace")
                        d.logprobs.add(
                            token_id=100 + k, token=token, token_bytes=data, logprob=-0.25
                        )
                    if k == 0 and c == 0 and call.params.HasField("prompt_logprobs"):
                        top = call.params.prompt_logprobs
                        d.prompt_logprobs.extend(prompt_logprobs(top, self.prompt_ids))
                    if last:
                        d.finish_reason = pb.FINISH_REASON_LENGTH
                if last:
                    resp.usage.prompt_tokens = len(PROMPT_IDS)
                    resp.usage.completion_tokens = n * len(self.pieces)
                queue.put_nowait((i, resp))
            queue.put_nowait(None)
        return [f"r{i}" for i in range(len(calls))]

    def cancel(self, ids: list[str]) -> None:
        self.cancelled += ids

    async def close(self) -> None:
        return None


class FakeStub:
    """The control plane's unary calls the gateway makes while serving: Detokenize (each
    id as "t<id>")."""

    async def Detokenize(self, req: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(text="".join(f"t{i}" for i in req.token_ids))


class FakeLink:
    def __init__(self) -> None:
        self.mux = FakeMux()
        self.closed = False
        self.sampling_defaults: dict[str, Any] = {}
        self.max_waiting = 0

    async def model_name(self) -> str:
        return MODEL

    async def settings(self) -> PlaneSettings:
        return PlaneSettings(self.sampling_defaults, self.max_waiting)

    async def info(self, timeout: float = 2.0) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(model_name=MODEL, max_model_len=2048, compute_attached=True)

    def open(self) -> FakeStub:
        return FakeStub()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self.closed = True
