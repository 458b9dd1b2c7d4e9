"""Overlapped steps: step k + 1 launched before step k finished (its samples still on the
device) gives the results and logits of running the steps one after the other.

On a GPU machine (benchmarks/device/check.sh) the engine runs on CUDA (bf16, Triton), where
step k is still computing when step k + 1 is launched."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine, Launched
from compute_plane.loader import load_model
from compute_plane.model_runner import PENDING, ModelRunner
from hetero_proto import compute_pb2 as pb
from tests.compute.step_driver import GREEDY, StepDriver
from tests.conftest import make_tiny_model

CHUNK = 8  # prefill tokens per request per step
PENALISED = pb.SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5)
# request -> (prompt, sampling, first step, last step: released in the step after)
PLAN: dict[str, tuple[list[int], pb.SamplingParams, int, int]] = {
    "a": ([5, 17, 33, 2, 90, 41, 7, 11, 12], GREEDY, 0, 15),
    "b": ([(7 * i + 3) % 250 + 3 for i in range(20)], GREEDY, 0, 15),  # three chunks
    "c": ([4, 8, 15, 16, 23], GREEDY, 3, 15),  # joins decoding requests
    "d": ([99, 98, 97, 96], GREEDY, 1, 5),  # leaves while its last sample is pending
    "p": ([30, 31, 32, 30, 31], PENALISED, 6, 9),  # needs its tokens on the host
    "s": ([60, 61, 62], pb.SamplingParams(temperature=0.9, top_p=0.8, seed=11), 2, 14),
    "l": ([70, 71], pb.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), 4, 16),
    # prompt logprobs, over two chunks (read on the host when their step finishes)
    "q": ([(5 * i + 1) % 250 + 3 for i in range(12)], pb.SamplingParams(prompt_logprobs=2), 2, 8),
}
MASKED_AT = 9  # a step where "a" samples under a token mask


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:  # type: ignore[no-untyped-def]
    out: Path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", out)
    config = ComputeConfig(
        model=str(out), block_size=4, kv_cache_bytes=8 << 20, gpu_memory_utilization=0.05
    )
    e = Engine(config, load_model(out, progress=False))
    e.capture_logits = True
    return e


def _schedule(engine: Engine) -> list[pb.StepRequest]:
    """The steps a control plane would send, fixed in advance (no request stops early)."""
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=5)
    computed: dict[str, int] = {}
    steps = []
    for k in range(17):
        new, cont, finished = [], [], []
        for rid, (prompt, sampling, first, last) in PLAN.items():
            if k == last + 1:
                finished.append(rid)
            if not first <= k <= last:
                continue
            done = computed.get(rid, 0)
            n = min(CHUNK, len(prompt) - done) if done < len(prompt) else 1
            if rid not in computed:
                new.append(drv.new(rid, prompt, n, sampling=sampling))
            else:
                cont.append(drv.cont(rid, n))
            computed[rid] = done + n
        step = drv.step(new=new, cont=cont, finished=finished)
        if k == MASKED_AT:
            step.masks.add(request_id="a", size=256, ids=[3, 40, 41, 200])
        steps.append(step)
    return steps


def _fresh(engine: Engine, staged: bool) -> None:
    engine.reset()
    engine.captured_logits.clear()
    engine.runner = ModelRunner(
        engine.model,
        engine.kv_cache,
        None,
        64,
        8,
        engine.max_model_len,
        engine.device,
        staged=staged,
    )


def _comparable(r: pb.StepResult) -> pb.StepResult:
    r.ClearField("forward_ns")
    r.ClearField("sample_ns")
    r.ClearField("prepare_ns")
    return r


@pytest.mark.parametrize("staged", [False, True], ids=["host-views", "staged"])
def test_overlapped_steps_equal_sequential_ones(engine: Engine, staged: bool) -> None:
    if engine.device.type != "cpu" and not staged:
        pytest.skip("off the CPU the inputs are always staged")
    steps = _schedule(engine)
    _fresh(engine, staged)
    sequential = [_comparable(engine.step(s)) for s in steps]
    logits = {rid: torch.cat(v) for rid, v in engine.captured_logits.items()}

    _fresh(engine, staged)
    overlapped: list[pb.StepResult] = []
    prev: Launched | None = None
    gathered = 0  # decode rows whose input was the previous step's sample, on the device
    for s in steps:
        pending = {
            rid for rid, st in engine.requests.items() if st.token_ids and st.token_ids[-1] < 0
        }
        launched = engine.launch(s)
        gathered += len(pending & set(s.decode_ids))
        if prev is not None:
            overlapped.append(_comparable(engine.finish(prev)))
        prev = launched
    assert prev is not None
    overlapped.append(_comparable(engine.finish(prev)))

    assert gathered >= 40, "the steps did not overlap"
    assert overlapped == sequential
    scored = [t for r in sequential for p in r.prompt_logprobs for t in p.tokens]
    assert len(scored) == 11 and all(len(t.top_logprobs) == 2 for t in scored)
    assert PENDING not in [t for st in engine.requests.values() for t in st.token_ids]
    assert set(engine.captured_logits) == set(logits)
    for rid, v in engine.captured_logits.items():
        assert torch.equal(torch.cat(v), logits[rid]), rid
    # Every request sampled a token each step it decoded (d's last one after it left).
    tokens = [t for r in sequential for t in r.sampled_token_ids]
    assert len(tokens) == sum(len(r.sampled_ids) for r in sequential) > 50


def test_a_step_that_needs_host_tokens_waits_for_the_pending_ones(engine: Engine) -> None:
    """A penalised request reads its output tokens on the host: launching its step settles
    the earlier step's samples first (and nothing is left PENDING)."""
    _fresh(engine, staged=engine.device.type != "cpu")
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=1)
    engine.step(drv.step(new=[drv.new("x", [5, 6, 7], 3, sampling=PENALISED)]))
    g = engine.launch(drv.step(new=[drv.new("g", [9, 10], 2)]))
    assert g.samples is not None and engine.requests["g"].token_ids[-1] == PENDING
    x = engine.launch(drv.step(cont=[drv.cont("x", 1), drv.cont("g", 1)]))
    assert engine.requests["g"].token_ids[-2] != PENDING  # settled before x launched
    assert g.ready() and engine.requests["x"].token_ids[-1] == PENDING
    r1, r2 = engine.finish(g), engine.finish(x)
    assert list(r1.sampled_ids) == ["g"] and sorted(r2.sampled_ids) == ["g", "x"]
    assert r1.sampled_token_ids[0] == engine.requests["g"].token_ids[-2]


def test_a_step_whose_samples_a_reset_dropped_answers_aborted(engine: Engine) -> None:
    _fresh(engine, staged=engine.device.type != "cpu")
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=2)
    launched = engine.launch(drv.step(new=[drv.new("g", [9, 10, 11], 3)]))
    engine.reset()
    result = engine.finish(launched)
    assert result.error.code == "ABORTED" and not result.sampled_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_step_launches_behind_the_running_one_without_a_host_sync(
    tmp_path: Path,
) -> None:
    """On CUDA, launching a decode step while the last one computes syncs nothing with the
    host: its inputs go through the staged buffers, its tokens are gathered from the last
    step's samples on the device, and the graph replays behind it. A blocking copy, an
    `.item()` or a `.tolist()` on the way would wait for the running step, and the
    overlap would be gone (torch's sync debug mode raises on each; it does not see an
    event's synchronize, which launch uses only to reuse the last step's pinned inputs)."""
    make_tiny_model("llama", tmp_path)
    config = ComputeConfig(model=str(tmp_path), block_size=4, gpu_memory_utilization=0.05)
    engine = Engine(config, load_model(tmp_path, progress=False))
    engine.warmup()  # autotunes and captures the decode graphs (both sync)
    assert engine.overlap and engine.graphs is not None
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=9)
    rids = [f"g{i}" for i in range(5)]
    engine.step(drv.step(new=[drv.new(r, [3 + 7 * i + j for j in range(6)], 6)
                              for i, r in enumerate(rids)]))  # fmt: skip
    prev = engine.launch(drv.step(cont=[drv.cont(r, 1) for r in rids]))
    results = []
    for k in range(12):
        step = drv.step(cont=[drv.cont(r, 1) for r in rids])
        strict = k >= 3  # (the first ones meet their shapes: Triton may compile)
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            pending = [rid for rid in rids if engine.requests[rid].token_ids[-1] == PENDING]
            launched = engine.launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert pending == rids, "each decode row's input is the running step's sample"
        results.append(engine.finish(prev))
        prev = launched
    results.append(engine.finish(prev))
    assert all(sorted(r.sampled_ids) == rids for r in results)
    # The device's idle time before each step, by its events: each of these steps came
    # behind a timed one. One launched 50 ms after the last finished waited that long.
    assert all(r.HasField("device_idle_ns") for r in results)
    time.sleep(0.05)
    late = engine.step(drv.step(cont=[drv.cont(r, 1) for r in rids]))
    assert 50e6 <= late.device_idle_ns < 1e9
    assert max(r.device_idle_ns for r in results[4:]) < late.device_idle_ns  # (no compiles)


class _HostClockEvent:
    """In place of a CUDA timing event, off CUDA: the host's clock when it is recorded."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: _HostClockEvent) -> float:
        return (later.at - self.at) * 1e3  # ms, as torch.cuda.Event's


def test_device_idle_time_runs_from_the_last_timed_steps_end(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StepResult.device_idle_ns: from the last timed step's end event to this step's
    start event; none after a reset or after a step with no events."""
    monkeypatch.setattr(ModelRunner, "_timing_event", lambda self: _HostClockEvent())
    _fresh(engine, staged=False)
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=3)
    rids = ["x", "y"]

    def decode() -> pb.StepResult:
        return engine.step(drv.step(cont=[drv.cont(r, 1) for r in rids]))

    new = [drv.new(r, [5 + i, 9, 11], 3) for i, r in enumerate(rids)]
    assert not engine.step(drv.step(new=new)).HasField("device_idle_ns")  # (a reset before)
    time.sleep(0.05)
    late, soon = decode(), decode()
    assert 50e6 <= late.device_idle_ns < 1e9
    assert 0 <= soon.device_idle_ns < late.device_idle_ns
    monkeypatch.setattr(ModelRunner, "_timing_event", lambda self: None)  # (as off CUDA)
    assert not decode().HasField("device_idle_ns")
    monkeypatch.setattr(ModelRunner, "_timing_event", lambda self: _HostClockEvent())
    assert not decode().HasField("device_idle_ns")  # the last step had no end event
    assert decode().HasField("device_idle_ns")
    engine.reset()  # (a new epoch: the device may have idled for any reason since)
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=4)
    new = [drv.new(r, [7 + i, 9, 11], 3) for i, r in enumerate(rids)]
    assert not engine.step(drv.step(new=new)).HasField("device_idle_ns")
    assert decode().HasField("device_idle_ns")


class _FinishedMidway(Launched):
    """A step that `Engine.finish` (on the step thread) clears right after the server's
    waiter thread first reads its samples: the interleaving of the two threads, made
    certain."""

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        value = super().__getattribute__(name)
        if name in ("samples", "prompt_logprobs") and value is not None:
            object.__setattr__(self, name, None)
        return value


def test_waiting_on_a_step_that_finish_clears_meanwhile_does_not_raise() -> None:
    class Copy:
        def __init__(self) -> None:
            self.waited = 0

        def ready(self) -> bool:
            return False

        def wait(self) -> None:
            self.waited += 1

    samples, copy = Copy(), Copy()
    launched = _FinishedMidway(pb.StepResult(), samples=samples)  # type: ignore[arg-type]
    launched.prompt_logprobs = type("Lps", (), {"copy": copy})()  # type: ignore[assignment]
    launched.wait()
    assert (samples.waited, copy.waited) == (1, 1)
    assert launched.samples is None and launched.prompt_logprobs is None

    launched = _FinishedMidway(pb.StepResult(), samples=Copy())  # type: ignore[arg-type]
    assert launched.ready() is False
