"""The control plane's gRPC link to a compute plane reads a step's result of any size."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from hetero_common.limits import MAX_TOP_LOGPROBS
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc
from tests.control.fake_compute import linked


class LongPromptLogprobs(pb_grpc.ComputePlaneServicer):
    """A compute plane whose every step computed `positions` prompt positions of one
    request that asked for prompt logprobs with the most alternatives."""

    def __init__(self, positions: int) -> None:
        self.positions = positions

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return pb.DescribeResponse(model_name="stand-in", block_size=16, num_kv_blocks=2)

    async def Reset(
        self, request: pb.ResetRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetResponse:
        return pb.ResetResponse()

    async def Run(
        self, request_iterator: AsyncIterator[pb.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        async for step in request_iterator:
            result = pb.StepResult(step_id=step.step_id)
            lps = result.prompt_logprobs.add(request_id="r", start=1)
            for i in range(self.positions):
                token = lps.tokens.add(token_id=40_000 + i % 9000, logprob=-1.5, rank=7)
                for k in range(MAX_TOP_LOGPROBS):
                    token.top_logprobs.add(token_id=30_000 + k, logprob=-0.25 - k)
            yield result


def test_a_step_result_past_grpcs_default_4_mib_is_read() -> None:
    """Prompt logprobs with 20 alternatives are ~230 bytes a position: a step that computes
    20,000 prompt positions (--max-num-batched-tokens 32768, prompts that ask for them)
    answers ~4.6 MB. The client read at most gRPC's default 4 MiB: RESOURCE_EXHAUSTED
    ended the Run stream and the compute plane was taken for lost."""
    servicer = LongPromptLogprobs(positions=20_000)

    async def main() -> pb.StepResult:
        async with linked(servicer) as client:
            await client.attach()
            await client.send(pb.StepRequest(step_id=1))
            return await client.receive()

    result = asyncio.run(main())
    assert result.ByteSize() > 4 << 20
    assert result.step_id == 1 and len(result.prompt_logprobs[0].tokens) == 20_000
