"""Client-side helpers for driving the control plane's public gRPC API in tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc


@dataclass
class Completion:
    texts: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    deltas: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, int] = field(default_factory=dict)
    usage: pb.Usage | None = None
    prompt_ids: list[int] = field(default_factory=list)


def generate(
    stub: pb_grpc.ControlPlaneStub, request: pb.GenerateRequest, timeout: float = 300
) -> Completion:
    out = Completion()
    for resp in stub.Generate(request, timeout=timeout):
        out.prompt_ids.extend(resp.prompt_token_ids)
        for c in resp.choices:
            out.texts[c.index] = out.texts.get(c.index, "") + c.text
            out.tokens.setdefault(c.index, []).extend(c.token_ids)
            out.deltas.setdefault(c.index, []).append(c.text)
            if c.finish_reason:
                out.finish[c.index] = c.finish_reason
        if resp.HasField("usage"):
            out.usage = resp.usage
    return out


def greedy(prompt_ids: list[int], max_tokens: int, **params: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids),
        params=pb.GenerationParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params
        ),  # type: ignore[arg-type]
    )
