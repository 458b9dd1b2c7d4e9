"""Quantized weights on the CPU (compute_plane/quant.py, csrc/quant_linear_cpu.c):
GGUF blocks converted exactly (gguf-py's own dequantisation is the reference), the C
kernels against dense matmuls, and the bundled model quantized against it dequantized."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from compute_plane.quant import MAX_KERNEL_ROWS, QuantWeight, cat, from_gguf, prepare, quantize_q8

RNG = np.random.default_rng(0)


def _random_q4_k(n: int, k: int) -> np.ndarray:
    """Raw Q4_K blocks (gguf-py cannot make them): random codes, scales and mins."""
    blocks = RNG.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    heads = RNG.uniform(0.001, 0.05, size=(n * k // 256, 2)).astype(np.float16)
    blocks[:, :4] = heads.view(np.uint8)
    return blocks.reshape(n, k // 256 * 144)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q4_K])
def test_gguf_blocks_convert_exactly(qtype: QT) -> None:
    """Each format's values exactly, and in as few bytes as the kernels take: the formats
    that store fp16 scales keep them in fp16 (Q4_K's d * sc need more bits)."""
    n, k = 48, 512
    if qtype == QT.Q4_K:
        data = _random_q4_k(n, k)
    else:
        data = quantize(RNG.standard_normal((n, k)).astype(np.float32), qtype)
    q = from_gguf(data, qtype, n, k)
    assert q is not None and q.kind == ("q8" if qtype in (QT.Q8_0, QT.Q5_0) else "q4")
    expected = dequantize(data, qtype).reshape(n, k)
    assert np.array_equal(q.dequantize().numpy(), expected.astype(np.float32))
    assert q.half == (qtype != QT.Q4_K)
    per_weight = {"q4": 0.5 + 4 / 32, "q8": 1 + 2 / 32} if q.half else {"q4": 0.75}
    assert q.nbytes == n * k * per_weight[q.kind]


def test_other_formats_are_requantized_to_int8() -> None:
    n, k = 16, 256
    data = quantize(RNG.standard_normal((n, k)).astype(np.float32), QT.Q5_1)
    q = from_gguf(data, QT.Q5_1, n, k)
    assert q is not None and q.kind == "q8"
    expected = dequantize(data, QT.Q5_1).reshape(n, k)
    err = np.abs(q.dequantize().numpy() - expected).max()
    assert err <= np.abs(expected).max() / 127  # half a step of int8 per group, at most
    assert from_gguf(np.zeros((n, k), np.float32), QT.F32, n, k) is None


def test_requantized_scales_are_fp16_where_every_group_allows() -> None:
    """quantize_q8 rounds each scale max|w_g| / 127 up to fp16 (no code leaves -127..127,
    each at most half a step off); a weight with a group too small for a normal fp16
    scale keeps fp32 scales, and that group its precision."""
    w = torch.randn(32, 128)
    q = quantize_q8(w)
    assert q.half
    codes, scales = q.rows()
    assert codes.abs().max() <= 127
    step = w.view(32, 4, 32).abs().amax(-1) / 127
    assert (scales >= step).all() and (scales <= step * (1 + 2**-10)).all()
    err = (q.dequantize() - w).view(32, 4, 32).abs().amax(-1)
    assert (err <= scales / 2 * (1 + 1e-6)).all()
    w[3, 32:64] *= 1e-6  # max|w_g| / 127 below fp16's normal range
    tiny = quantize_q8(w)
    assert not tiny.half
    err = (tiny.dequantize() - w)[3, 32:64].abs().max()
    assert err <= w[3, 32:64].abs().max() / 254 * (1 + 1e-6)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_fp16_scales_give_the_same_bits_as_fp32(kind: str) -> None:
    """Scales that fp16 holds exactly are kept in fp16; the linear (either activations, at
    every tile size, with a padded last block) and dequantize give the same bits as with
    the same scales in fp32."""
    n, k = 40, 128
    codes, scales = _random_rows(kind, n, k)
    scales = scales.half().float()
    q = QuantWeight.pack(kind, codes, scales)
    assert q.half and q.scales.dtype == torch.float16
    wide = QuantWeight(kind, q.codes, q.scales.float(), n, k)
    assert not wide.half and q.nbytes < wide.nbytes
    assert torch.equal(q.dequantize(), wide.dequantize())
    assert torch.equal(q.rows()[1], scales)
    bias = torch.randn(n)
    for rows in (1, 2, 3, 4, 5, 8, 9, 40):
        x = torch.randn(rows, k)
        for activations in ("fp32", "int16"):
            got = q.linear(x, bias, activations)
            assert torch.equal(got, wide.linear(x, bias, activations)), (rows, activations)


def _int16_bound(q: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """The most int16 activations can move each output [M, N]: x is rounded per group of
    32 to int16 steps of max|x_g| / 32767, so each element by at most half a step, and
    output n by sum_g (|s_ng| * sum_j |code_ngj| + 32 |b_ng|) * step_mg / 2 (q4's offsets
    meet the rounded x too)."""
    n = q.shape[0]
    rows, scales = q.rows()
    if q.kind == "q4":
        lo, hi = rows & 0x0F, rows >> 4
        codes = torch.cat([lo.view(n, -1, 16), hi.view(n, -1, 16)], -1).double()
        s, b = scales[..., 0].double(), scales[..., 1].double()
    else:
        codes, s = rows.view(n, -1, 32).double(), scales.double()
        b = torch.zeros_like(s)
    weight = s.abs() * codes.abs().sum(-1) + 32 * b.abs()  # [N, G]
    step = x.view(x.shape[0], -1, 32).abs().amax(-1).double() / 32767  # [M, G]
    return step @ weight.T / 2


@pytest.mark.parametrize("activations", ["fp32", "int16"])
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 16, 17, 40, 128, 300])
def test_linear_matches_the_dense_weight(kind: str, rows: int, activations: str) -> None:
    """The C kernel against x @ w.T + b: exact to fp32 rounding, or (int16 activations)
    within the bound of their rounding. 72 channels: 4 blocks of 16 and a padded one."""
    n, k = 72, 320
    if kind == "q4":
        codes = torch.from_numpy(RNG.integers(0, 256, size=(n, k // 2), dtype=np.uint8))
        q = QuantWeight.pack("q4", codes, torch.randn(n, k // 32, 2) * 0.05)
    else:
        q = quantize_q8(torch.randn(n, k))
    dense = q.dequantize()
    x, bias = torch.randn(rows, k), torch.randn(n)
    expected = x.double() @ dense.double().T + bias.double()
    got = q.linear(x, bias, activations)
    assert got.shape == (rows, n)
    err = (got.double() - expected).abs()
    fp32 = 1e-4 * (1 + expected.abs())
    if activations == "fp32":
        assert (err <= fp32).all(), err.max()
    else:
        bound = _int16_bound(q, x)
        assert (err <= bound + fp32).all(), (err - bound).max()
        assert err.max() > 1e-6  # it does round: the bound is what is being checked
    again = q.linear(x[None], None, activations)[0].double()
    assert torch.allclose(again, got.double() - bias.double(), atol=1e-4)
    _batch_independent(q, bias, activations)


def _batch_independent(q: QuantWeight, bias: torch.Tensor, activations: str) -> None:
    """A row's result does not depend on its batch: alone, and at every place among 1 to
    2 x MAX_KERNEL_ROWS other rows (every tile size of the kernel), it is bit for bit the
    same. A row of 0.01s with one 1000 per group makes int16's rounding visible (steps of
    1000 / 32767 take every 0.01 to 0), so the row is rounded, not passed through."""
    k = q.shape[1]
    x = torch.full((1, k), 0.01)
    x[0, ::32] = 1000.0
    alone = q.linear(x, bias, activations)[0]
    for before, after in [(0, 1), (3, 4), (5, 2), (7, 0), (8, 8), (MAX_KERNEL_ROWS, 100)]:
        rows = torch.cat([torch.randn(before, k), x, torch.randn(after, k)])
        got = q.linear(rows, bias, activations)[before]
        assert torch.equal(got, alone), (before, after)


def _random_rows(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales of an [n, k] weight in the row layout (QuantWeight)."""
    if kind == "q4":
        codes = torch.from_numpy(RNG.integers(0, 256, size=(n, k // 2), dtype=np.uint8))
        return codes, torch.randn(n, k // 32, 2)
    codes = torch.from_numpy(RNG.integers(-128, 128, size=(n, k), dtype=np.int8))
    return codes, torch.randn(n, k // 32)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("n", [16, 33, 96])
def test_the_kernels_layout_round_trips(kind: str, n: int) -> None:
    """Row layout -> blocks of 16 channels -> row layout is the identity, the padding of a
    last partial block is zero, and dequantize reads the blocks as the rows say."""
    k = 96
    codes, scales = _random_rows(kind, n, k)
    q = QuantWeight.pack(kind, codes, scales)
    back_codes, back_scales = q.rows()
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
    assert q.codes.shape[0] == -(-n // 16) and q.nbytes == q.codes.nbytes + q.scales.nbytes
    # By hand from the row layout (q4: byte j = element j low, j + 16 high nibble).
    if kind == "q4":
        elems = torch.cat(
            [torch.cat([g & 0x0F, g >> 4], -1) for g in codes.view(n, k // 32, 16).unbind(1)], -1
        )
        dense = elems.float().view(n, -1, 32) * scales[..., :1] + scales[..., 1:]
    else:
        dense = codes.float().view(n, -1, 32) * scales[..., None]
    assert torch.allclose(q.dequantize(), dense.view(n, k), rtol=1e-6, atol=1e-6)
    ng, first_pad = k // 32, n % 16  # channels [n % 16, 16) of the last block are padding
    if first_pad:
        per = 8 if kind == "q4" else 16  # records of 32 bytes per group
        assert not q.codes[-1].view(ng, per, 16, 2)[:, :, first_pad:].any()
        assert not q.scales[-1].view(ng, -1, 16)[..., first_pad:].any()


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_packing_takes_a_row_permutation(kind: str) -> None:
    """pack(rows=perm) puts row perm[r] in channel r: what packing the permuted rows gives
    (the loader un-permutes GGUF's rotary rows this way); a row out of range is refused."""
    n, k = 40, 64
    codes, scales = _random_rows(kind, n, k)
    perm = RNG.permutation(n)
    q = QuantWeight.pack(kind, codes, scales, rows=perm)
    back_codes, back_scales = q.rows()
    assert torch.equal(back_codes, codes[perm]) and torch.equal(back_scales, scales[perm])
    assert torch.equal(q.dequantize(), QuantWeight.pack(kind, codes, scales).dequantize()[perm])
    with pytest.raises(IndexError):
        QuantWeight.pack(kind, codes, scales, rows=np.array([0, n]))
    with pytest.raises(ValueError, match="codes"):  # the C kernel reads them as bytes
        QuantWeight.pack(kind, codes.to(torch.int16), scales)
    with pytest.raises(ValueError, match="scales"):
        QuantWeight.pack(kind, codes, scales[:-1])


def test_rows_fuse_and_look_up() -> None:
    a, b = quantize_q8(torch.randn(8, 64)), quantize_q8(torch.randn(4, 64))
    fused = cat([a, b])
    assert isinstance(fused, QuantWeight) and fused.shape == (12, 64)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    ids = torch.tensor([11, 0, 5])
    assert torch.equal(fused.dequantize(ids), fused.dequantize()[ids])
    mixed = cat([a, torch.randn(4, 64)])  # a dense part: all dense
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (12, 64)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_whole_blocks_fuse_as_their_rows_would(kind: str) -> None:
    """Parts of whole 16-row blocks are fused by putting their packed blocks one after
    another: the same bytes as packing the concatenated rows."""
    g = torch.Generator().manual_seed(0)

    def weight(n: int, k: int = 64) -> QuantWeight:
        if kind == "q8":
            codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            return QuantWeight.pack(kind, codes, torch.rand(n, k // 32, generator=g))
        codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        return QuantWeight.pack(kind, codes, torch.randn(n, k // 32, 2, generator=g))

    parts = [weight(32), weight(16), weight(48)]
    half = weight(16)
    half = QuantWeight.pack(kind, half.rows()[0], half.rows()[1].half().float())
    assert half.half and not parts[0].half
    mixed = cat([parts[0], half])  # fp16 and fp32 scales: fp32
    assert isinstance(mixed, QuantWeight) and mixed.scales.dtype == torch.float32
    assert torch.equal(mixed.dequantize(), torch.cat([parts[0].dequantize(), half.dequantize()]))
    both = cat([half, half])
    assert isinstance(both, QuantWeight) and both.half
    fused = cat(parts)
    assert isinstance(fused, QuantWeight) and fused.shape == (96, 64)
    rows = [p.rows() for p in parts]
    want = QuantWeight.pack(kind, torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows]))
    assert torch.equal(fused.codes, want.codes) and torch.equal(fused.scales, want.scales)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    ragged = cat([weight(20), weight(16)])  # a part that ends inside a block: re-packed
    assert isinstance(ragged, QuantWeight) and ragged.shape == (36, 64)


def test_prepare_modes() -> None:
    weights = {
        "m": torch.randn(8, 64),
        "norm": torch.randn(64),
        "q": quantize_q8(torch.randn(8, 64)),
    }
    dense = prepare(weights, None)
    assert all(isinstance(w, torch.Tensor) for w in dense.values())
    int8 = prepare(weights, "int8")
    assert isinstance(int8["m"], QuantWeight) and isinstance(int8["norm"], torch.Tensor)
    assert prepare(weights, "gguf")["m"] is weights["m"]


# ------------------------------------------------------- the bundled model
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "import numpy as np\n",
    "In 1492, Columbus",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "SELECT name FROM users WHERE",
    "The speed of light is",
    "A haiku about autumn:",
    "The French word for cat is",
    "Machine learning is",
    "Dear Sir or Madam,",
    "1, 1, 2, 3, 5, 8,",
    "The opposite of hot is",
]
TEXT = (
    "The sun rose over the quiet harbour, and the fishermen pushed their boats into the "
    "grey water. Gulls followed them out past the lighthouse, calling to each other."
)


def _run(path: Path, quantization: str) -> tuple[list[list[int]], float, int]:
    """Greedy 16 tokens for each prompt, mean log-likelihood of TEXT, weight bytes."""
    from compute_plane.config import ComputeConfig
    from hetero_infer.offline import OfflineLLM
    from hetero_proto import control_pb2 as pb

    config = ComputeConfig(
        model=str(path), metrics_port=-1, quantization=quantization, kv_cache_bytes=32 << 20
    )
    llm = OfflineLLM(str(path), compute=config)
    params = [pb.GenerationParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    tokens = [c.token_ids[0] for c in llm.generate(PROMPTS, params)]
    ids = llm.tokenizer.encode(TEXT)
    llm.engine.capture_logits = True
    llm.generate([ids], [pb.GenerationParams(max_tokens=1, temperature=0.0)])
    logits = torch.cat(next(iter(llm.engine.captured_logits.values())))[: len(ids) - 1]
    logp = torch.log_softmax(logits.double(), -1)[torch.arange(len(ids) - 1), ids[1:]]
    return tokens, float(logp.mean()), llm.engine.describe().weight_bytes


@pytest.mark.slow
def test_bundled_model_quantized_matches_dequantized(smollm2_path: Path) -> None:
    q_tokens, q_ll, q_bytes = _run(smollm2_path, "auto")
    d_tokens, d_ll, d_bytes = _run(smollm2_path, "none")
    same = sum(
        a == b
        for qa, da in zip(q_tokens, d_tokens, strict=True)
        for a, b in zip(qa, da, strict=True)
    )
    total = sum(len(t) for t in d_tokens)
    assert same >= 0.9 * total, (same, total)
    assert math.isclose(q_ll, d_ll, rel_tol=0.02), (q_ll, d_ll)
    assert d_bytes >= 3.5 * q_bytes, (d_bytes, q_bytes)
