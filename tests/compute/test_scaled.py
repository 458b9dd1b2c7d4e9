"""FP8 and INT8 weights off the CPU's fp32 kernels (compute_plane/scaled.py,
`--quantization fp8|int8` in bf16/fp16, FP8 checkpoints kept in FP8).

torch runs `_scaled_mm` and `_weight_int8pack_mm` on the CPU too, so the arithmetic the
GPU path runs is checked here: against an fp64 emulation of the same FP8 rounding,
against the dequantized weights, and a whole tiny model against transformers in fp32.
Throughput needs a GPU (`benchmarks.gpu`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine, load_for
from compute_plane.loader import load_model
from compute_plane.scaled import (
    FP8,
    FP8_MAX,
    ScaledWeight,
    quantize_fp8,
    quantize_int8,
    reencode,
)
from tests.compute.step_driver import StepDriver
from tests.compute.test_parity import _fp8_checkpoint
from tests.conftest import make_tiny_model


def _emulated_fp8(x: torch.Tensor, w: ScaledWeight) -> torch.Tensor:
    """x @ w.T with x rounded per row to e4m3 as the kernel rounds it, in fp64."""
    x64 = x.double()
    sx = (x64.abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    xq = (x64 / sx).float().clamp(-FP8_MAX, FP8_MAX).to(FP8).double() * sx
    return xq @ w.dequantize().double().T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fp8_linear_is_the_fp8_product(rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    w = torch.randn(48, 64) * torch.linspace(0.1, 3.0, 48)[:, None]  # channels' scales differ
    x = torch.randn(rows, 64, dtype=dtype) * torch.linspace(0.5, 4.0, rows)[:, None].to(dtype)
    q = quantize_fp8(w.to(dtype))
    assert q.data.dtype == FP8 and q.scale.shape == (48,)
    bias = torch.randn(48, dtype=dtype)
    got = q.linear(x, bias).double()
    assert got.shape == (rows, 48)
    want = _emulated_fp8(x, q) + bias.double()
    # bf16 output: 8 bits of mantissa, on values up to |want|.
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()
    # ... and FP8 rounds: the dense product differs by more than the output rounding.
    dense = x.double() @ w.to(dtype).double().T + bias.double()
    assert (dense - want).abs().max() > 2**-7 * want.abs().max()
    assert (dense - want).abs().max() <= 0.15 * dense.abs().max()


def test_fp8_weights_round_per_channel() -> None:
    w = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]  # 4 decades apart
    q = quantize_fp8(w)
    back = q.dequantize()
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value (normal range).
    normal = w.abs() >= q.scale[:, None] * 2**-6
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= 2**-4 + 1e-6
    assert torch.equal(q.data.float().abs().amax(1), torch.full((32,), FP8_MAX))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_weight_only_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    q = quantize_int8(w)
    assert q.data.dtype == torch.int8
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(5, 96, dtype=dtype)
    got = q.linear(x).double()
    want = x.double() @ q.dequantize().to(dtype).double().T
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()


def test_an_fp8_weight_becomes_int8_where_fp8_matmuls_do_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import compute_plane.scaled as scaled

    q = quantize_fp8(torch.randn(16, 32))
    assert reencode(q, torch.device("cpu")) is q  # the CPU runs them (torch's reference)
    monkeypatch.setattr(scaled, "fp8_supported", lambda device: False)  # e.g. an A100
    w8 = reencode(q, torch.device("cpu"))
    assert w8.kind == "int8" and w8.data.dtype == torch.int8
    assert ((w8.dequantize() - q.dequantize()).abs() <= w8.scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_an_fp8_checkpoint_stays_fp8_bit_for_bit(tmp_path: Path, layout: str) -> None:
    from safetensors.torch import load_file

    _fp8_checkpoint(make_tiny_model("llama", tmp_path), tmp_path, layout)
    raw = load_file(str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, torch.bfloat16, progress=False, keep_fp8=True)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = loaded.weights[name]
    if layout == "block":  # block scales: dequantized (no per-channel form)
        assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
        return
    assert isinstance(w, ScaledWeight) and w.kind == "fp8"
    assert torch.equal(w.data.view(torch.uint8), raw[name].view(torch.uint8))
    scale = raw[name.removesuffix("weight") + "weight_scale"].float().reshape(-1)
    assert torch.equal(w.scale, scale.expand(w.shape[0]) if scale.numel() == 1 else scale)


def _logits(path: Path, quantization: str, dtype: str) -> tuple[Engine, torch.Tensor, list[int]]:
    cfg = ComputeConfig(
        model=str(path), block_size=4, kv_cache_bytes=64 << 20, quantization=quantization,
        dtype=dtype, gpu_memory_utilization=0.05,  # on a GPU: a small pool, as on the CPU
    )  # fmt: skip
    engine = Engine(cfg, load_for(cfg, path))
    engine.capture_logits = True
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=1)
    rng = random.Random(1)
    prompt = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(11)]
    engine.step(drv.step(new=[drv.new("r", prompt, 7)]))  # a chunk, then the rest
    engine.step(drv.step(cont=[drv.cont("r", 4)]))
    for _ in range(5):
        engine.step(drv.step(cont=[drv.cont("r", 1)]))
    logits = torch.cat(engine.captured_logits["r"]).float().cpu()  # (beside transformers')
    return engine, logits, engine.requests["r"].token_ids[: len(logits)]


# Stated tolerances, max |ours - transformers fp32| over the tiny model's logits (their
# largest magnitude is ~0.6): bf16 alone moves them ~0.005; weight-only INT8 adds ~1e-3;
# FP8 weights and per-token FP8 activations ~0.04.
TOLERANCE = {"none": 0.02, "int8": 0.02, "fp8": 0.1}


@pytest.mark.parametrize("quantization", ["none", "int8", "fp8"])
def test_a_tiny_model_in_bf16_with_fp8_or_int8_weights(tmp_path: Path, quantization: str) -> None:
    ref = make_tiny_model("llama", tmp_path)
    engine, ours, seq = _logits(tmp_path, quantization, "bfloat16")
    mode = {"none": "", "int8": "int8_scaled", "fp8": "fp8"}[quantization]
    assert engine.describe().quantization == mode
    layer = engine.model.layers[0]
    if quantization == "none":
        assert isinstance(layer.qkv, torch.Tensor)
    else:
        assert isinstance(layer.qkv, ScaledWeight) and layer.qkv.kind == quantization
    with torch.no_grad():
        expected = ref(torch.tensor([seq])).logits[0].float()
    assert ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff <= TOLERANCE[quantization], (quantization, diff)


def test_fp8_and_int8_halve_the_layer_matrices(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path)
    sizes = {q: _logits(tmp_path, q, "bfloat16")[0].model.weight_bytes for q in ("none", "fp8")}
    layers = sum(
        p.numel() * 2
        for n, p in make_tiny_model("llama", tmp_path / "again").state_dict().items()
        if ".layers." in n and n.endswith("_proj.weight")
    )
    # bf16 -> 1 byte per value, plus 4 bytes of scale per output channel.
    assert sizes["none"] - sizes["fp8"] >= layers / 2 - 4 * layers / 2 / 64
