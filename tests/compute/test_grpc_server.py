"""The compute plane as a separate process, driven through its gRPC `Run` stream."""

from __future__ import annotations

import asyncio
import math
import queue
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.compute_client import ComputeClient, sampled_tokens
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc
from tests.compute.step_driver import StepDriver
from tests.conftest import hf_greedy_batch
from tests.procs import compute_plane

KV_BYTES = 48 << 20
PROMPTS = [
    "Once upon a time, in a land far away,",
    "The quick brown fox",
    "Here is a short poem about the sea and the wind that blows over the water:",
    "The capital city of France is well known for its",
]
NEW_TOKENS = 32


class RunStream:
    """One `Run` stream: send a step, get its result."""

    def __init__(self, stub: pb_grpc.ComputePlaneStub) -> None:
        self.queue: queue.Queue[pb.StepRequest | None] = queue.Queue()
        self.results: Iterator[pb.StepResult] = stub.Run(iter(self.queue.get, None))

    def send(self, step: pb.StepRequest) -> pb.StepResult:
        self.queue.put(step)
        result = next(self.results)
        assert result.step_id == step.step_id
        return result

    def close(self) -> None:
        self.queue.put(None)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with compute_plane("--kv-cache-bytes", str(KV_BYTES)) as address:
        yield address


@pytest.fixture(scope="module")
def channel(address: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(address) as ch:
        yield ch


@pytest.fixture()
def stub(channel: grpc.Channel) -> pb_grpc.ComputePlaneStub:
    s = pb_grpc.ComputePlaneStub(channel)
    s.Reset(pb.ResetRequest())
    return s


def test_health_and_describe_match_model(stub, channel, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    d = stub.Describe(pb.DescribeRequest())
    c = hf_smollm2.config
    assert d.architecture == "llama"
    assert d.num_layers == c.num_hidden_layers == 30
    assert d.num_attention_heads == c.num_attention_heads
    assert d.num_kv_heads == c.num_key_value_heads
    assert d.hidden_size == c.hidden_size
    assert d.head_dim == c.hidden_size // c.num_attention_heads
    assert d.vocab_size == c.vocab_size
    assert list(d.eos_token_ids) == [c.eos_token_id]
    assert d.block_size == 16 and d.dtype == "float32" and d.device == "cpu"
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * d.head_dim * 4
    assert d.num_kv_blocks == KV_BYTES // per_block
    assert d.kv_cache_bytes == d.num_kv_blocks * per_block
    assert d.max_model_len == min(c.max_position_embeddings, (d.num_kv_blocks - 1) * 16)


def _greedy_reference(hf_smollm2, tokenizer) -> dict[str, tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    prompts = [tokenizer(text).input_ids for text in PROMPTS]
    answers = hf_greedy_batch(hf_smollm2, prompts, NEW_TOKENS)
    return {f"r{i}": (ids, out) for i, (ids, out) in enumerate(zip(prompts, answers, strict=True))}


@pytest.fixture(scope="module")
def greedy_reference(hf_smollm2, hf_smollm2_tokenizer):  # type: ignore[no-untyped-def]
    return _greedy_reference(hf_smollm2, hf_smollm2_tokenizer)


def test_four_concurrent_greedy_requests_match_transformers(stub, greedy_reference) -> None:  # type: ignore[no-untyped-def]
    d = stub.Describe(pb.DescribeRequest())
    drv = StepDriver(d.num_kv_blocks, d.block_size, seed=7)
    stream = RunStream(stub)
    got: dict[str, list[int]] = {rid: [] for rid in greedy_reference}

    def record(result: pb.StepResult) -> None:
        assert not result.HasField("error"), result.error.message
        for rid, token in sampled_tokens(result).items():
            got[rid].append(token)

    # r0, r1 arrive first; r2 joins one step later (so prefill and decode mix);
    # r3's prompt is prefilled in two chunks.
    (p0, _), (p1, _), (p2, _), (p3, _) = greedy_reference.values()
    record(stream.send(drv.step(new=[drv.new("r0", p0, len(p0)), drv.new("r1", p1, len(p1))])))
    record(
        stream.send(
            drv.step(
                new=[drv.new("r2", p2, len(p2)), drv.new("r3", p3, 2)],
                cont=[drv.cont("r0", 1), drv.cont("r1", 1)],
            )
        )
    )
    record(
        stream.send(
            drv.step(
                cont=[
                    drv.cont("r0", 1),
                    drv.cont("r1", 1),
                    drv.cont("r2", 1),
                    drv.cont("r3", len(p3) - 2),
                ]
            )
        )
    )
    final_tables: dict[str, list[int]] = {}
    while any(len(t) < NEW_TOKENS for t in got.values()):
        live = [rid for rid, t in got.items() if len(t) < NEW_TOKENS]
        done = [rid for rid, t in got.items() if len(t) == NEW_TOKENS and rid in drv.tables]
        for rid in done:
            final_tables[rid] = drv.tables.pop(rid)
        record(stream.send(drv.step(cont=[drv.cont(rid, 1) for rid in live], finished=done)))
    stream.close()
    # Blocks of different requests interleave in the pool: no table is one contiguous run.
    for rid, table in final_tables.items():
        assert len(table) > 1 and table != list(range(table[0], table[0] + len(table))), (
            rid,
            table,
        )
    for rid, (_, expected) in greedy_reference.items():
        assert got[rid][:NEW_TOKENS] == expected, rid


def test_malformed_steps_are_rejected_and_others_go_on(stub, greedy_reference) -> None:  # type: ignore[no-untyped-def]
    """A step of the wrong shape is rejected whole; a new request with bad fields fails
    alone, and the step runs for the others."""
    d = stub.Describe(pb.DescribeRequest())
    drv = StepDriver(d.num_kv_blocks, d.block_size, seed=11)
    stream = RunStream(stub)
    prompt, expected = greedy_reference["r0"]
    tokens: list[int] = []

    def ok(step: pb.StepRequest) -> pb.StepResult:
        res = stream.send(step)
        assert not res.HasField("error"), res.error.message
        tokens.extend(res.sampled_token_ids)
        return res

    def new(rid: str, tokens: list[int], blocks: list[int], **sampling: float) -> pb.NewRequest:
        return pb.NewRequest(
            request_id=rid,
            token_ids=tokens,
            num_prompt_tokens=len(tokens),
            num_scheduled_tokens=len(tokens),
            block_ids=blocks,
            sampling=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
        )

    ok(drv.step(new=[drv.new("good", prompt, len(prompt))]))
    shape_cases = {
        "unknown request id 'ghost'": pb.StepRequest(
            continuing=[pb.ContinuingRequest(request_id="ghost", num_scheduled_tokens=1)]
        ),
        "unknown request id 'phantom'": pb.StepRequest(decode_ids=["phantom"]),
        "'good' appears twice": pb.StepRequest(decode_ids=["good"]),
    }
    for i, (needle, bad) in enumerate(shape_cases.items()):
        ok(drv.step(cont=[drv.cont("good", 1)]))
        bad.step_id = 10_000 + i
        # A valid request in the same step is not run either: the step is rejected whole.
        bad.continuing.append(pb.ContinuingRequest(request_id="good", num_scheduled_tokens=1))
        res = stream.send(bad)
        assert res.error.code == "INVALID_ARGUMENT"
        assert needle in res.error.message, res.error.message
        assert len(res.sampled_ids) == 0
    vocab, bs = d.vocab_size, d.block_size
    request_cases = {
        f"block id {d.num_kv_blocks} out of range": new("x", [1, 2, 3], [d.num_kv_blocks]),
        "do not fit in 1 blocks": new("y", list(range(3, 3 + bs + 1)), [5]),
        "temperature": new("z", [5, 6], [6], temperature=math.nan),
        f"token id out of range 0..{vocab - 1}": new("v", [5, vocab], [7]),
        f"token id 1000000000 (min_tokens_banned_ids) not in 0..{vocab - 1}": pb.NewRequest(
            request_id="w",
            token_ids=[5, 6],
            num_prompt_tokens=2,
            num_scheduled_tokens=2,
            block_ids=[8],
            sampling=pb.SamplingParams(min_tokens=1, min_tokens_banned_ids=[10**9]),
        ),
    }
    for needle, bad_request in request_cases.items():
        # The bad request fails alone: "good" computes and samples in the same step.
        step = drv.step(cont=[drv.cont("good", 1)])
        step.new_requests.append(bad_request)
        res = ok(step)
        assert list(res.sampled_ids) == ["good"]
        (failure,) = res.failed
        assert failure.request_id == bad_request.request_id
        assert failure.code == "INVALID_ARGUMENT"
        assert needle in failure.message, failure.message
    while len(tokens) < NEW_TOKENS:
        ok(drv.step(cont=[drv.cont("good", 1)]))
    assert tokens == expected
    stats = stub.Stats(pb.StatsRequest())
    assert stats.num_active_requests == 1
    assert stats.num_failed_requests == len(request_cases) and stats.num_resets == 0
    stream.close()
    # The driver's stream ended: its requests are forgotten (it moved them or is gone).
    for _ in range(200):
        if stub.Stats(pb.StatsRequest()).num_active_requests == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the requests outlived their control plane's stream")


def test_one_control_plane_drives_it_at_a_time(stub, address) -> None:  # type: ignore[no-untyped-def]
    """While a control plane's Run stream is open, another connection's Reset and Run are
    refused (its block pool owns this KV cache); once the stream ends, it may take over."""
    run = RunStream(stub)
    run.send(pb.StepRequest(step_id=1))
    # A separate connection, as another control plane process has.
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=options) as other:
        rival = pb_grpc.ComputePlaneStub(other)
        rival.Describe(pb.DescribeRequest(), timeout=30)  # anyone may look
        with pytest.raises(grpc.RpcError) as refused:
            rival.Reset(pb.ResetRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "driven by another control plane" in (refused.value.details() or "")
        rival_run = RunStream(rival)
        with pytest.raises(grpc.RpcError) as refused:
            rival_run.send(pb.StepRequest(step_id=1))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stub.Reset(pb.ResetRequest(), timeout=30)  # the driver's own connection may
        run.close()
        for _ in range(100):  # the server sees the stream end
            try:
                rival.Reset(pb.ResetRequest(), timeout=30)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
                time.sleep(0.05)
        else:
            raise AssertionError("the compute plane stayed claimed after the stream ended")
        taken = RunStream(rival)
        assert taken.send(pb.StepRequest(step_id=2)).step_id == 2
        taken.close()


def test_a_step_past_grpcs_default_4_mib_goes_through() -> None:
    """A step carries each new request's every known token: many long requests admitted
    at once (on a cached prefix, each computing a token or a few) pass gRPC's default 4 MiB
    receive limit. The link reads any size: the step runs (it ended the Run stream with
    RESOURCE_EXHAUSTED, and the control plane took the compute plane for lost)."""

    async def main(address: str) -> tuple[pb.StepResult, int]:
        client = ComputeClient(address)
        try:
            d = await client.attach()
            # Each request: max_model_len - 1 known ids of 3 bytes each on the wire, one
            # token computed now (a chunk of its prompt: nothing sampled), in one block.
            ids = [16384 + i % (d.vocab_size - 16384) for i in range(d.max_model_len - 1)]
            n = (5 << 20) // (3 * len(ids)) + 1
            step = pb.StepRequest(step_id=1)
            for i in range(n):
                step.new_requests.add(
                    request_id=f"r{i}",
                    token_ids=ids,
                    num_prompt_tokens=len(ids),
                    num_scheduled_tokens=1,
                    block_ids=[1 + i % (d.num_kv_blocks - 1)],
                )
            assert step.ByteSize() > 5 << 20
            await client.send(step)
            result = await client.receive()
            await client.send(pb.StepRequest(step_id=2, finished_ids=[f"r{i}" for i in range(n)]))
            await client.receive()
            return result, n
        finally:
            await client.close()

    # A pool of the whole context (8192 tokens): fewer, longer requests make the size.
    with compute_plane("--kv-cache-bytes", str(8300 * 46080)) as address:
        result, n = asyncio.run(main(address))
    assert result.step_id == 1 and result.num_seqs == n and not result.failed
    assert len(result.sampled_ids) == 0
