"""The engine with the Triton backend, through the engine's own call sites.

On a CPU the kernels run in the Triton interpreter: this is the CUDA path of the
engine (Triton attention, norms, rotary; KV writes through cache_ops) exercised in
CI. The reference is the same engine with the torch backend, and transformers.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from compute_plane.attention import AttentionMetadata, TorchPagedAttention
from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine
from compute_plane.loader import load_model
from compute_plane.model_runner import ModelRunner
from tests.compute.step_driver import StepDriver
from tests.conftest import make_tiny_model
from tests.kernels.reference import DEVICE, ON_GPU, PagedCache

pytest.importorskip("triton")

from compute_plane.attention.triton_backend import TritonPagedAttention

BLOCK = 8


def test_backend_matches_torch_backend_on_a_mixed_step() -> None:
    """Decodes and prefill chunks in one step; the caches end up equal too."""
    h, kvh, d = 8, 2, 80
    seq_lens, query_lens = [9, 1, 16, 21, 5], [1, 1, 1, 13, 5]
    caches = [PagedCache(20, BLOCK, kvh, d, torch.float32, seed=5) for _ in range(2)]
    tables = caches[0].tables(seq_lens)
    slots = []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n - q, n)]
    t = len(slots)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, x, d, generator=g).to(DEVICE) for x in (h, kvh, kvh))
    outs = []
    for backend, cache in zip(
        (TorchPagedAttention(d**-0.5), TritonPagedAttention(d**-0.5, kvh, num_sms=0)),
        caches,
        strict=True,
    ):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=DEVICE),
            block_tables=tables,
            seq_lens=seq_lens,
            query_lens=query_lens,
            num_decodes=3,
            block_size=BLOCK,
        )
        backend.prepare(meta)
        outs.append(backend.forward(q, k, v, cache.k, cache.v, meta))
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    err = (outs[0] - outs[1]).abs().max().item()
    assert err <= 1e-4, f"max abs difference {err:.2e}"


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def tiny(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A Qwen3-shaped model (q/k norm, GQA 2:1, head dim 80), or a Gemma 3 one (two
    sliding-window layers of 6 and a global one), and transformers' copy of it."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        return out, make_tiny_model("gemma3", out)
    ref = make_tiny_model("qwen3", out, head_dim=80, num_hidden_layers=2)
    return out, ref


def _engine(
    path: Path,
    backend: str,
    staged: bool = False,
    fused_linear: str = "off",
    pdl: str = "off",
    graphs: bool = False,
) -> Engine:
    """`graphs` (CUDA): decode graphs up to 8 sequences, piecewise graphs up to 16 tokens."""
    cfg = ComputeConfig(
        model=str(path),
        device=DEVICE.type,
        dtype="float32",
        attention_backend=backend,
        block_size=BLOCK,
        kv_cache_bytes=4 << 20,
        gpu_memory_utilization=0.05,  # on a GPU: a small pool, as on the CPU
        cuda_graphs=graphs,
        max_num_seqs=8,
        piecewise_graphs=16,
        fused_linear=fused_linear,
        pdl=pdl,
    )
    engine = Engine(cfg, load_model(path, progress=False))
    engine.warmup()  # where the fused linears are switched on
    engine.capture_logits = True
    if staged:  # the GPU's input path: each step copied into device buffers, views of them
        engine.runner = ModelRunner(
            engine.model, engine.kv_cache, None, *engine.runner.capacity[:2],
            engine.max_model_len, engine.device, staged=True,
        )  # fmt: skip
    return engine


def _drive(engine: Engine) -> dict[str, list[int]]:
    """Chunked prefill, a mixed step, batched decodes, a prefix hit; returns the tokens."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    a = [rng.randrange(3, vocab) for _ in range(19)]
    b = [rng.randrange(3, vocab) for _ in range(5)]
    drv = StepDriver(engine.num_blocks, BLOCK, seed=1)
    steps = [
        drv.step(new=[drv.new("a", a, 11)]),  # first chunk
        drv.step(cont=[drv.cont("a", 8)]),  # second chunk over a cached prefix of 11
        drv.step(new=[drv.new("b", b, 5)], cont=[drv.cont("a", 1)]),  # decode + prefill
        drv.step(cont=[drv.cont("a", 1), drv.cont("b", 1)]),
        drv.step(cont=[drv.cont("a", 1), drv.cont("b", 1)]),
    ]
    for s in steps:
        res = engine.step(s)
        assert not res.HasField("error"), res.error.message
    # "c" shares a's first two full blocks (16 tokens) and computes only its own tail.
    c = a[:16] + [rng.randrange(3, vocab) for _ in range(4)]
    shared = drv.tables["a"][:2]
    new = drv.new("c", c, 4, num_computed=16, shared_blocks=shared)
    res = engine.step(drv.step(new=[new], cont=[drv.cont("a", 1), drv.cont("b", 1)]))
    assert not res.HasField("error"), res.error.message
    return {rid: list(st.token_ids) for rid, st in engine.requests.items()}


HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launches need a Hopper or later GPU",
)


@pytest.mark.parametrize(
    ("staged", "fused_linear", "pdl", "graphs"),
    [
        (False, "off", "off", False),
        (True, "off", "off", False),
        (True, "on", "off", False),
        pytest.param(True, "on", "on", False, marks=[*ON_GPU, HOPPER]),
        pytest.param(False, "off", "off", True, marks=ON_GPU),
        pytest.param(False, "on", "auto", True, marks=ON_GPU),
    ],
    ids=[
        "host-views",
        "staged",
        "fused-linears",
        "dependent-launches",
        "cuda-graphs",
        "cuda-graphs-fused",
    ],
)
def test_engine_logits_equal_the_torch_backend(
    tiny, staged: bool, fused_linear: str, pdl: str, graphs: bool
) -> None:  # type: ignore[no-untyped-def]
    """With fused linears on, every step here (at most 11 tokens) runs a layer's norms
    and SiLU inside its projections' kernels (kernels/fused_linear.py). With `--pdl on`
    (a Hopper GPU) every Triton kernel of a step is a programmatic dependent launch: a
    read before its wait for the kernel before would change the logits. With CUDA graphs
    (a GPU) the decode steps replay decode graphs and the others (chunks, the mixed
    step, the prefix hit) piecewise graphs at 16 tokens, attention eager between them."""
    path, ref = tiny
    triton_engine = _engine(path, "triton", staged, fused_linear, pdl, graphs)
    torch_engine = _engine(path, "torch")
    if graphs:
        assert triton_engine.graphs is not None and triton_engine.pieces is not None
        assert triton_engine.pieces.sizes == [16]
        assert len(triton_engine.pieces.pieces[16]) == triton_engine.model_config.num_layers + 1
    assert triton_engine.dependent_launch == (pdl == "on")
    assert triton_engine.model.fused_rows == (16 if fused_linear == "on" else 0)
    assert triton_engine.describe().attention_backend == "triton"
    assert torch_engine.describe().attention_backend == "torch"
    tokens = _drive(triton_engine)
    assert tokens == _drive(torch_engine)
    if graphs:  # 2 chunks, the mixed step, the prefix hit; 2 steps of 2 decodes
        forwards = triton_engine.runner.forwards
        assert forwards == {"piecewise": 4, "decode_graph": 2, "eager": 0}, forwards
    for rid in ("a", "b", "c"):
        ours = torch.cat(triton_engine.captured_logits[rid])
        theirs = torch.cat(torch_engine.captured_logits[rid])
        err = (ours - theirs).abs().max().item()
        assert err <= 1e-4, f"{rid}: max abs logit difference {err:.2e}"
        # And against transformers over the whole sequence ("c" computed only its tail).
        computed = triton_engine.requests[rid].num_computed_tokens
        start = computed - len(ours)
        with torch.no_grad():
            expected = ref(torch.tensor([tokens[rid][:computed]])).logits[0, start:]
        err = (ours.cpu() - expected).abs().max().item()
        assert err <= 1e-3, f"{rid}: max abs logit difference to transformers {err:.2e}"


def test_verifying_proposals_keeps_greedy_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    """Speculative decoding on the Triton path: a proposal's k + 1 tokens go to the decode
    kernel as one-token queries of the request (each one more position); greedy tokens
    with proposals, right or wrong, equal those of one-token steps."""
    from hetero_proto import compute_pb2 as pb

    path, _ = tiny
    engine = _engine(path, "triton")
    engine.capture_logits = False
    vocab = engine.model_config.vocab_size
    prompt = [random.Random(3).randrange(3, vocab) for _ in range(10)]

    def run(propose: bool, plain: list[int] | None = None) -> list[int]:
        engine.reset()
        drv = StepDriver(engine.num_blocks, BLOCK, seed=2)
        res = engine.step(drv.step(new=[drv.new("a", prompt, len(prompt))]))
        out = list(res.sampled_token_ids)
        while len(out) < 8:
            k = 0
            step_props = []
            if propose and plain is not None:
                right = plain[len(out) : len(out) + 3]
                guess = [*right[:-1], (right[-1] + 1) % vocab] if len(right) == 3 else right
                k = len(guess)
                if k:
                    step_props.append(pb.Proposal(request_id="a", token_ids=guess))
            new_ids = drv._grow("a", len(prompt) + len(out) + k)
            step = drv.step(
                cont=[
                    pb.ContinuingRequest(
                        request_id="a", new_block_ids=new_ids, num_scheduled_tokens=1
                    )
                ]
            )
            step.proposals.extend(step_props)
            res = engine.step(step)
            assert not res.HasField("error") and not res.failed, (res.error, res.failed)
            acc = [list(a.token_ids) for a in res.accepted]
            out += (acc[0] if acc else []) + list(res.sampled_token_ids)
        return out[:8]

    plain = run(False)
    assert run(True, plain) == plain
    assert engine.stats().num_accepted_tokens > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_dependent_launches_need_a_hopper_gpu(tiny) -> None:  # type: ignore[no-untyped-def]
    """`--pdl auto` on a CPU launches as before; `--pdl on` there is refused at start-up
    with the flag named, and `--pdl maybe` is not a mode."""
    path, _ = tiny
    assert not _engine(path, "triton", pdl="auto").dependent_launch
    with pytest.raises(ValueError, match="--pdl on needs the Triton path on a Hopper"):
        _engine(path, "triton", pdl="on")
    with pytest.raises(ValueError, match="pdl must be auto, on or off"):
        ComputeConfig(model=str(path), pdl="maybe")


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_GPU, id="cuda")])
def test_warm_up_checks_the_cupy_kernels_and_a_failure_only_warns(
    tiny, _: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """On CUDA the warm-up compiles and runs the KV-cache kernels (cache_ops) before any
    step; one that NVRTC refuses (as one the image's CuPy could not compile) gives one
    WARNING at warm-up and the engine steps as before, on torch's path."""
    pytest.importorskip("cupy")
    from compute_plane.kernels import cache_ops

    path = tiny[0]
    for f in (cache_ops._kernel, cache_ops._cupy_works):
        f.cache_clear()
    monkeypatch.setattr(cache_ops, "_COPY_BLOCKS", cache_ops._COPY_BLOCKS + "\nnot C++")
    caplog.set_level(logging.WARNING, logger=cache_ops.__name__)
    try:
        engine = _engine(path, "triton")
        (warning,) = [r for r in caplog.records if r.name == cache_ops.__name__]
        assert warning.levelno == logging.WARNING and "CompileException" in warning.getMessage()
        assert not cache_ops.uses_cupy(engine.kv_cache.layers[0][0])
        assert _drive(engine) == _drive(_engine(path, "torch"))
    finally:
        for f in (cache_ops._kernel, cache_ops._cupy_works):
            f.cache_clear()
