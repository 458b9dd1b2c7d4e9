"""Client-side helpers for driving the control plane's public gRPC API in tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero_common.accumulate import Accumulated
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

    @classmethod
    def of(cls, acc: Accumulated) -> Completion:
        ch = acc.choices
        return cls(
            texts={i: c.text for i, c in ch.items()},
            tokens={i: c.token_ids for i, c in ch.items()},
            deltas={i: c.deltas for i, c in ch.items()},
            finish={i: c.finish_reason for i, c in ch.items() if c.finish_reason},
            usage=acc.usage,
            prompt_ids=acc.prompt_token_ids,
        )


def generate(
    stub: pb_grpc.ControlPlaneStub, request: pb.GenerateRequest, timeout: float = 300
) -> Completion:
    acc = Accumulated()
    for resp in stub.Generate(request, timeout=timeout):
        acc.add(resp)
    return Completion.of(acc)


def greedy(prompt_ids: list[int], max_tokens: int, **params: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids),
        params=pb.GenerationParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params
        ),  # type: ignore[arg-type]
    )
