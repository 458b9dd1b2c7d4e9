"""A compute.proto server that returns a token the moment a step arrives.

A benchmark harness only (never a backend): with the model's cost at zero, the time
between a step's result and the next step is the control plane's own cost per step
(scheduling, building the step, gRPC both ways, detokenising, streaming to clients).

    python -m benchmarks.instant_compute --port 50099 --record gaps.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from hetero_common.grpc_health import HealthReporter
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc


class InstantCompute(pb_grpc.ComputePlaneServicer):
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.description = pb.DescribeResponse(
            model_name="instant",
            architecture="none",
            dtype="float32",
            device="none",
            block_size=block_size,
            num_kv_blocks=num_blocks,
            max_model_len=(num_blocks - 1) * block_size,
            vocab_size=vocab_size,
            eos_token_ids=[2],
            attention_backend="none",
        )
        # request id -> [tokens known, tokens computed]
        self.progress: dict[str, list[int]] = {}
        self.gaps: list[
            tuple[int, float]
        ] = []  # (sequences in the step, seconds since last result)

    async def Describe(self, request: pb.DescribeRequest, context: object) -> pb.DescribeResponse:
        return self.description

    async def Reset(self, request: pb.ResetRequest, context: object) -> pb.ResetResponse:
        self.progress.clear()
        return pb.ResetResponse()

    async def Stats(self, request: pb.StatsRequest, context: object) -> pb.StatsResponse:
        return pb.StatsResponse(num_active_requests=len(self.progress))

    async def Run(
        self, request_iterator: AsyncIterator[pb.StepRequest], context: object
    ) -> AsyncIterator[pb.StepResult]:
        last: float | None = None
        async for step in request_iterator:
            now = time.perf_counter()
            result = self.answer(step)
            if last is not None:
                self.gaps.append((result.num_seqs, now - last))
            last = time.perf_counter()
            yield result

    def answer(self, step: pb.StepRequest) -> pb.StepResult:
        """The step's result: a token for each request whose known tokens are all computed."""
        ids: list[str] = []
        tokens: list[int] = []
        for rid in step.finished_ids:
            self.progress.pop(rid, None)
        for r in step.new_requests:
            self.progress[r.request_id] = [len(r.token_ids), r.num_computed_tokens]
            self._advance(r.request_id, r.num_scheduled_tokens, ids, tokens)
        for c in step.continuing:
            self._advance(c.request_id, c.num_scheduled_tokens, ids, tokens)
        for rid in step.decode_ids:
            self._advance(rid, 1, ids, tokens)
        n = len(step.new_requests) + len(step.continuing) + len(step.decode_ids)
        return pb.StepResult(
            step_id=step.step_id, sampled_ids=ids, sampled_token_ids=tokens, num_seqs=n
        )

    def _advance(self, rid: str, n: int, ids: list[str], tokens: list[int]) -> None:
        p = self.progress[rid]
        p[1] += n
        if p[1] == p[0]:  # all known tokens computed: sample one
            ids.append(rid)
            tokens.append(100 + (p[0] * 7919) % 20000)
            p[0] += 1


async def serve(port: int, record: Path, num_blocks: int, block_size: int, vocab: int) -> None:
    """Serve until SIGTERM, then write the recorded gaps to `record` as JSON."""
    server = grpc.aio.server()
    servicer = InstantCompute(num_blocks, block_size, vocab)
    pb_grpc.add_ComputePlaneServicer_to_server(servicer, server)
    health = HealthReporter(server, pb.DESCRIPTOR.services_by_name["ComputePlane"].full_name)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health.set(True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    record.write_text(json.dumps(servicer.gaps))
    await server.stop(grace=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--record", type=Path, required=True, help="JSON file of step gaps (on exit)")
    ap.add_argument("--num-blocks", type=int, default=100_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=49152)
    args = ap.parse_args()
    asyncio.run(serve(args.port, args.record, args.num_blocks, args.block_size, args.vocab_size))


if __name__ == "__main__":
    main()
