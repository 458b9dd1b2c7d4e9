"""Logit parity with Hugging Face transformers (fp32, max abs diff <= 1e-3).

Our engine runs hand-built steps over a paged KV cache with shuffled block ids; the
reference is transformers' own forward over each request's whole sequence.

The quantized cases run the CPU's quantized kernels and, for their decode steps, the
fused C decode (compute_plane/decode_cpu.py): the bundled model with its 4-bit weights
kept quantized against transformers' own dequantisation of the same GGUF, and tiny
models quantized with `--quantization int8` against transformers running on the
dequantized int8 weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine, load_for
from compute_plane.model import onednn_linear
from compute_plane.quant import quantize_q8
from tests.compute.step_driver import StepDriver
from tests.conftest import make_tiny_model

TOL = 1e-3
BLOCK = 4


def _engine(
    path: Path,
    block_size: int = BLOCK,
    quantization: str = "auto",
    fused: bool = False,
    backend: str = "cpu",
) -> Engine:
    cfg = ComputeConfig(
        model=str(path),
        block_size=block_size,
        kv_cache_bytes=64 << 20,
        quantization=quantization,
        cpu_activations="fp32",  # exact; int16's rounding: tests/compute/test_quant.py
        attention_backend=backend,
    )
    engine = Engine(cfg, load_for(cfg, path))
    # The default CPU backend: decodes by the C kernel, prefill chunks by SDPA.
    assert engine.describe().attention_backend == backend
    # ... and the linear layers by oneDNN where this torch has it (so parity covers it).
    if torch.backends.mkldnn.is_available():
        assert engine.model.dense_linear is onednn_linear
    # Quantized weights: decode steps by the fused C forward.
    assert (engine.model.fused is not None) == fused
    engine.capture_logits = True
    return engine


def _dequantized_int8(model):  # type: ignore[no-untyped-def]
    """`model` with every matrix `--quantization int8` quantizes replaced by its int8
    weights, dequantized: what our int8 engine computes with."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                p.copy_(quantize_q8(p.data).dequantize())
    return model


CASES = ["llama", "llama3-rope", "qwen2", "qwen3", "gemma3", "gemma3-torch"]
CASES += ["smollm2", "smollm2-q4"]
CASES += ["llama-int8", "qwen2-int8", "qwen3-int8", "gemma3-int8"]
CASES += ["llama-fp8-tensor", "qwen2-fp8-channel", "qwen3-fp8-block"]
FP8_MAX = 448.0  # largest finite e4m3 value


def _fp8_checkpoint(model, out: Path, layout: str):  # type: ignore[no-untyped-def]
    """Rewrite `out` as an FP8 checkpoint in vLLM's "fp8" format (e4m3 layer matrices, a
    scale per tensor, per output channel or per 16x16 block) and return `model` with
    those weights dequantized: what our engine must compute with."""
    import json

    from safetensors.torch import save_file

    tensors = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.dim() != 2 or ".layers." not in name:
                tensors[name] = p.contiguous()
                continue
            w = p.float()
            if layout == "tensor":
                scale = w.abs().max() / FP8_MAX
                full = scale.expand_as(w)
            elif layout == "channel":
                scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
                full = scale.expand_as(w)
            else:  # 16x16 blocks; the last ones may be partial
                rows, cols = -(-w.shape[0] // 16), -(-w.shape[1] // 16)
                scale = torch.zeros(rows, cols)
                for i in range(rows):
                    for j in range(cols):
                        tile = w[16 * i : 16 * i + 16, 16 * j : 16 * j + 16]
                        scale[i, j] = tile.abs().max() / FP8_MAX
                full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
                full = full[: w.shape[0], : w.shape[1]]
            w8 = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            tensors[name] = w8
            stem = name.removesuffix("weight")
            tensors[stem + ("weight_scale_inv" if layout == "block" else "weight_scale")] = scale
            tensors[stem + "input_scale"] = torch.tensor(1.0)  # static activation scale: unused
            p.copy_((w8.float() * full).to(p.dtype))
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    if layout == "block":
        cfg["quantization_config"].update(activation_scheme="dynamic", weight_block_size=[16, 16])
    (out / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory, smollm2_path):  # type: ignore[no-untyped-def]
    """(our engine, HF reference model)."""
    name = request.param
    if name.startswith("smollm2"):
        ref = request.getfixturevalue("hf_smollm2")
        quantized = name == "smollm2-q4"
        mode = "auto" if quantized else "none"
        return _engine(smollm2_path, block_size=16, quantization=mode, fused=quantized), ref
    out = tmp_path_factory.mktemp(name)
    if "-fp8-" in name:
        arch, layout = name.split("-fp8-")
        ref = _fp8_checkpoint(make_tiny_model(arch, out), out, layout)
        return _engine(out), ref
    if name.endswith("-int8"):
        ref = _dequantized_int8(make_tiny_model(name.removesuffix("-int8"), out))
        return _engine(out, quantization="int8", fused=True), ref
    if name == "gemma3-torch":  # decodes by the torch backend's windowed masks
        ref = make_tiny_model("gemma3", out)
        return _engine(out, backend="torch"), ref
    if name == "llama3-rope":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        ref = make_tiny_model("llama", out, rope_scaling=scaling, rope_theta=500000.0)
    else:
        ref = make_tiny_model(name, out)
    return _engine(out), ref


def _tokens(engine: Engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, engine.model_config.vocab_size) for _ in range(n)]


def _check(engine: Engine, ref, rid: str, start: int = 0) -> None:  # type: ignore[no-untyped-def]
    """Captured logits of `rid` (positions start..) equal the reference's on the same tokens."""
    ours = torch.cat(engine.captured_logits[rid])
    seq = engine.requests[rid].token_ids[: start + len(ours)]
    with torch.no_grad():
        expected = ref(torch.tensor([seq])).logits[0, start:].float()
    assert ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff <= TOL, f"{rid}: max abs logit diff {diff:.2e} > {TOL}"


def _decode(engine: Engine, drv: StepDriver, rids: list[str], steps: int) -> None:
    for _ in range(steps):
        res = engine.step(drv.step(cont=[drv.cont(r, 1) for r in rids]))
        assert not res.HasField("error"), res.error.message
        assert sorted(res.sampled_ids) == sorted(rids)


def test_one_prompt(case) -> None:  # type: ignore[no-untyped-def]
    engine, ref = case
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=1)
    prompt = _tokens(engine, 11, seed=1)
    res = engine.step(drv.step(new=[drv.new("one", prompt, len(prompt))]))
    assert list(res.sampled_ids) == ["one"]
    _decode(engine, drv, ["one"], 5)
    _check(engine, ref, "one")
    engine.step(drv.step(finished=["one"]))


def test_batch_of_different_lengths(case) -> None:  # type: ignore[no-untyped-def]
    engine, ref = case
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=2)
    lengths = {"a": 3, "b": 17, "c": 1, "d": 9}
    news = [drv.new(r, _tokens(engine, n, seed=n), n) for r, n in lengths.items()]
    res = engine.step(drv.step(new=news))
    assert sorted(res.sampled_ids) == sorted(lengths)
    _decode(engine, drv, list(lengths), 4)
    for rid in lengths:
        _check(engine, ref, rid)
    engine.step(drv.step(finished=list(lengths)))


def test_chunked_prefill_then_decode(case) -> None:  # type: ignore[no-untyped-def]
    engine, ref = case
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=3)
    prompt = _tokens(engine, 30, seed=3)
    res = engine.step(drv.step(new=[drv.new("chunked", prompt, 7)]))
    assert len(res.sampled_ids) == 0  # a non-final chunk samples nothing
    done = 7
    while done < len(prompt):
        n = min(7, len(prompt) - done)
        res = engine.step(drv.step(cont=[drv.cont("chunked", n)]))
        done += n
        assert len(res.sampled_ids) == (1 if done == len(prompt) else 0)
    _decode(engine, drv, ["chunked"], 3)
    _check(engine, ref, "chunked")
    engine.step(drv.step(finished=["chunked"]))


def test_prefix_already_in_cached_blocks(case) -> None:  # type: ignore[no-untyped-def]
    engine, ref = case
    bs = engine.block_size
    drv = StepDriver(engine.num_blocks, bs, seed=4)
    half = 2 * bs
    first = _tokens(engine, 2 * half, seed=4)
    engine.step(drv.step(new=[drv.new("first", first, len(first))]))
    shared = drv.tables["first"][: half // bs]
    # The first request is gone from the compute plane; its blocks still hold the prefix.
    engine.step(drv.step(finished=["first"]))
    second = first[:half] + _tokens(engine, half, seed=5)
    engine.captured_logits.clear()
    new = drv.new("second", second, len(second) - half, num_computed=half, shared_blocks=shared)
    engine.step(drv.step(new=[new]))
    _decode(engine, drv, ["second"], 2)
    assert sum(len(x) for x in engine.captured_logits["second"]) == half + 2  # only the suffix ran
    _check(engine, ref, "second", start=half)
    engine.step(drv.step(finished=["second"]))


def test_prefill_then_32_decodes(case) -> None:  # type: ignore[no-untyped-def]
    """A 20-token prompt and 32 decode steps (Gemma 3: well past its tiny model's window)."""
    engine, ref = case
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=6)
    prompt = _tokens(engine, 20, seed=6)
    engine.step(drv.step(new=[drv.new("long", prompt, len(prompt))]))
    _decode(engine, drv, ["long"], 32)
    _check(engine, ref, "long")
    engine.step(drv.step(finished=["long"]))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_blocks_that_left_the_window_may_hold_another_request(backend, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Mistral with a window of 6 in every layer (Describe says so, and the control plane
    then gives back blocks behind the window): once "long" is past its first blocks, they
    go to "other", whose K/V overwrite them, and "long" still matches transformers."""
    ref = make_tiny_model("mistral", tmp_path, sliding_window=6)
    engine = _engine(tmp_path, backend=backend)
    assert engine.describe().sliding_window == 6
    drv = StepDriver(engine.num_blocks, engine.block_size, seed=7)
    prompt = _tokens(engine, 14, seed=7)
    engine.step(drv.step(new=[drv.new("long", prompt, len(prompt))]))
    _decode(engine, drv, ["long"], 3)  # the next query is at 17: it sees 12..17
    dead = drv.tables["long"][:3]  # positions 0..11
    other = _tokens(engine, 12, seed=8)
    engine.step(drv.step(new=[drv.new("other", other, len(other), shared_blocks=dead)]))
    _decode(engine, drv, ["long", "other"], 20)
    _check(engine, ref, "long")
    _check(engine, ref, "other")
