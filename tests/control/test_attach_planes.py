"""Which of the compute planes listed a control plane attaches: stand-in compute planes on
real gRPC servers (Describe, Reset and an idle Run stream), with the bundled model's
tokenizer; no model is loaded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.plane import UNFIT_REASONS
from control_plane.tokenizer import TokenizerWrapper, load_tokenizer
from hetero_common import weights
from hetero_infer.local import free_port
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc
from hetero_proto import control_pb2 as cpb
from tests.control.streams import stream_tokens


class _Compute(pb_grpc.ComputePlaneServicer):
    """Describes itself as `description`; a Reset takes `reset_delay` s (loading state, a
    slow link)."""

    def __init__(self, description: pb.DescribeResponse, reset_delay: float = 0.0) -> None:
        self.description = description
        self.reset_delay = reset_delay
        self.resets = 0
        self.steps = 0  # steps received (a step ends the stream with `die_at_step`)
        self.die_at_step = False
        self.driven = False  # another control plane drives it: Reset is refused

    async def Describe(self, request: pb.DescribeRequest, context: object) -> pb.DescribeResponse:
        return self.description

    async def Reset(
        self, request: pb.ResetRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetResponse:
        self.resets += 1
        if self.driven:  # (as compute_plane.server refuses a second control plane)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "driven elsewhere")
        await asyncio.sleep(self.reset_delay)
        return pb.ResetResponse()

    async def Run(
        self, request_iterator: AsyncIterator[pb.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        async for _ in request_iterator:  # (never answered)
            self.steps += 1
            if self.die_at_step:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the compute plane died")
        return
        yield pb.StepResult()  # (a generator: never reached)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_path)


def _weights(seed: int, layers: int = 30) -> bytes:
    """A weights fingerprint (hetero_common.weights) of random values: `seed` picks the
    weights (a fine-tune)."""
    rng = random.Random(seed)
    tensors = len(weights.sampled_names(layers))
    return weights.encode(
        [(False, [rng.gauss(0, 1) for _ in range(weights.SAMPLES)]) for _ in range(tensors)]
    )


def _describe(
    tok: TokenizerWrapper, layers: int = 30, other_vocab: bool = False, fine_tune: int = 0
) -> pb.DescribeResponse:
    """The bundled model's shape (`layers` changed: another size of it), its vocabulary
    or (`other_vocab`) another one of the same size, and the weights of `fine_tune`."""
    fingerprint = tok.vocab_fingerprint
    return pb.DescribeResponse(
        model_name=f"llama-{layers}",
        architecture="llama",
        device="cpu",
        block_size=16,
        num_kv_blocks=64,
        max_model_len=512,
        vocab_size=49152,
        eos_token_ids=[2],
        num_layers=layers,
        num_attention_heads=9,
        num_kv_heads=3,
        head_dim=64,
        hidden_size=576,
        vocab_fingerprint=bytes(len(fingerprint)) if other_vocab else fingerprint,
        weights_fingerprint=_weights(fine_tune, layers),
    )


async def _serve(servicer: _Compute, port: int = 0) -> tuple[grpc.aio.Server, str]:
    """`servicer` on a local port (a free one by default) and its address."""
    server = grpc.aio.server()
    pb_grpc.add_ComputePlaneServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _planes(*servicers: _Compute) -> AsyncIterator[list[str]]:
    """Each servicer on a free local port: their addresses."""
    served = [await _serve(servicer) for servicer in servicers]
    try:
        yield [address for _, address in served]
    finally:
        for server, _ in served:
            await server.stop(None)


async def _attached(
    tok: TokenizerWrapper, smollm2_path: Path, servicers: list[_Compute], **config: object
) -> dict[str, bool]:
    """Which compute planes a control plane listing them all (IP addresses: not read
    again) attached, a second after the first one was."""
    async with _planes(*servicers) as addresses:
        cfg = ControlConfig(
            model=str(smollm2_path),
            metrics_port=-1,
            compute=",".join(addresses),
            **config,  # type: ignore[arg-type]
        )
        control = ControlEngine(cfg, tok)
        await control.start()
        try:
            await asyncio.wait_for(control.first_attached(), 10)
            await asyncio.sleep(1.0)
            return {
                a: control.planes[a].attached.is_set() for a in addresses if a in control.planes
            }
        finally:
            await control.stop()


def test_an_unfit_plane_of_a_fixed_list_leaves_its_place_under_max_compute_planes(
    tokenizer: TokenizerWrapper, smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--compute A,B (IP addresses) with --max-compute-planes 1 and A serving another
    model: A is passed over and B attached, as with a host name or a file. A fixed list
    was never gone through again, so A held the only place: the control plane neither
    served nor stopped (before an unfit plane was passed over, it stopped, exit 2)."""
    unfit = _Compute(_describe(tokenizer, other_vocab=True))
    fit = _Compute(_describe(tokenizer))
    attached = asyncio.run(
        _attached(
            tokenizer,
            smollm2_path,
            [unfit, fit],
            max_compute_planes=1,
            compute_resolve_interval=0.2,
        )
    )
    assert list(attached.values()) == [True], attached
    assert unfit.resets == 0  # (never attached, nor reset)
    # One ERROR line: passed over, it was tried once more before it left (a second line,
    # refused then by the plane attached meanwhile). The control plane's lines only: the
    # stand-in planes' gRPC server may log a Run call cancelled at its stop.
    errors = [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith("control_plane")
    ]
    assert len(errors) == 1, [r.getMessage() for r in errors]


@pytest.mark.parametrize("differs", ["size", "weights"])
def test_two_planes_of_different_models_met_at_once_are_not_both_attached(
    tokenizer: TokenizerWrapper, smollm2_path: Path, differs: str
) -> None:
    """Two compute planes of one tokenizer and two sizes (SmolLM2-135M's 30 layers, a
    2-layer one) answer at once at start-up: the second checked is refused, as it is once
    the first is attached. Each was checked against the planes attached only, and neither
    was yet (a plane is attached once its Reset is answered): both were, and a request
    moved between them went on with another model's weights."""
    planes = [
        _Compute(_describe(tokenizer), reset_delay=0.3),
        _Compute(
            _describe(tokenizer, layers=2)
            if differs == "size"
            else _describe(tokenizer, fine_tune=1),
            reset_delay=0.3,
        ),
    ]
    attached = asyncio.run(_attached(tokenizer, smollm2_path, planes))
    assert sorted(attached.values()) == [False, True], attached


@pytest.mark.parametrize("differs", ["size", "weights"])
@pytest.mark.parametrize("where", ["another address", "its address"])
def test_a_plane_of_another_model_does_not_take_the_requests_waiting_for_a_lost_one(
    tokenizer: TokenizerWrapper, smollm2_path: Path, where: str, differs: str
) -> None:
    """The only compute plane attached dies with a request in flight; the request waits
    for it (--compute-timeout). A compute plane serving another size of the model, or
    another fine-tune of it (same shape, other weights), comes up, at another address
    listed or at the lost one's (restarted with another model): it is not attached while
    the request waits. It was (no plane was attached to compare it with), and the request
    went on there, its text continued by another model."""

    async def run() -> tuple[bool, int]:
        lost = _Compute(_describe(tokenizer))
        lost.die_at_step = True
        other = _Compute(
            _describe(tokenizer, layers=2)
            if differs == "size"
            else _describe(tokenizer, fine_tune=1)
        )
        server, address = await _serve(lost)
        later = f"127.0.0.1:{free_port()}" if where == "another address" else address
        cfg = ControlConfig(
            model=str(smollm2_path),
            metrics_port=-1,
            compute=f"{address},{later}" if later != address else address,
            compute_timeout=60.0,
        )
        control = ControlEngine(cfg, tokenizer)
        await control.start()
        other_server = None
        try:
            await asyncio.wait_for(control.first_attached(), 10)
            params = cpb.GenerationParams(max_tokens=4, temperature=0.0)
            waiting = asyncio.ensure_future(stream_tokens(control.submit([504, 3458], params)))
            while not lost.steps:
                await asyncio.sleep(0.02)
            await server.stop(None)
            other_server, _ = await _serve(other, int(later.rpartition(":")[2]))
            await asyncio.sleep(1.5)
            assert not waiting.done()
            waiting.cancel()
            return control.planes[later].attached.is_set(), other.steps
        finally:
            await control.stop()
            if other_server is not None:
                await other_server.stop(None)

    attached, steps = asyncio.run(run())
    assert not attached
    assert steps == 0


def _unfit(address: str) -> dict[str, float | None]:
    """hetero_compute_unfit{compute=address} by reason."""
    return {
        r: REGISTRY.get_sample_value(
            "hetero_compute_unfit", {"model_name": "unknown", "compute": address, "reason": r}
        )
        for r in UNFIT_REASONS
    }


def test_a_refused_plane_that_now_fits_is_no_longer_reported_unfit(
    tokenizer: TokenizerWrapper, smollm2_path: Path
) -> None:
    """A compute plane of another vocabulary is refused: hetero_compute_unfit is 1 for it
    (reason "vocabulary" or "tokenizer"). It is restarted with the right model, but another control
    plane drives it now (its Reset is refused, FAILED_PRECONDITION): it passed this control
    plane's check, so it is unfit no more and every reason reads 0. The gauge kept the old
    reason at 1 (an alert on it fired for a plane that fits) until it attached here."""

    async def run() -> tuple[dict[str, float | None], dict[str, float | None], bool]:
        fit = _Compute(_describe(tokenizer))
        other = _Compute(_describe(tokenizer, other_vocab=True))
        async with _planes(fit, other) as (first, address):
            cfg = ControlConfig(
                model=str(smollm2_path), metrics_port=-1, compute=f"{first},{address}"
            )
            control = ControlEngine(cfg, tokenizer)
            await control.start()
            try:
                await asyncio.wait_for(control.first_attached(), 10)
                plane = control.planes[address]
                while plane.unfit is None:
                    await asyncio.sleep(0.02)
                before = _unfit(address)
                other.description, other.driven = _describe(tokenizer), True
                resets = other.resets
                while other.resets == resets:  # (its check passed; its Reset is refused)
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.1)
                return before, _unfit(address), plane.attached.is_set()
            finally:
                await control.stop()

    before, after, attached = asyncio.run(run())
    # Refused as of another vocabulary: the fit plane's (when that one was checked first)
    # or this control plane's tokenizer's.
    assert [r for r, v in before.items() if v] in (["vocabulary"], ["tokenizer"]), before
    assert set(before.values()) == {0.0, 1.0}, before
    assert after == dict.fromkeys(UNFIT_REASONS, 0.0), after
    assert not attached
