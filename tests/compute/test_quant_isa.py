"""The quantized kernel's other instruction sets (csrc/quant_linear_cpu.c): built here with
AVX-512 (and for the plain C path AVX2, FMA, F16C) switched off, as a CPU without them
builds it, they compute what the native build does. A CI machine runs only its own
build's path otherwise."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from compute_plane.native import COMPILE_FLAGS, CSRC, LINK_FLAGS
from compute_plane.quant import QuantWeight, kernels_available

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or not kernels_available(), reason="needs a C compiler"
)

P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
VARIANTS = {  # name: (extra flags, what int16_kernel_kind reports)
    "avx2": (["-mno-avx512f"], 1),
    "plain": (["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"], 0),
}


def _has_avx2() -> bool:
    return "avx2" in Path("/proc/cpuinfo").read_text().split()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ctypes.CDLL:
    name = request.param
    if name == "avx2" and not _has_avx2():
        pytest.skip("this CPU has no AVX2")
    flags, kind = VARIANTS[name]
    out = tmp_path_factory.mktemp(name)
    src = CSRC / "quant_linear_cpu.c"
    subprocess.run(["cc", *COMPILE_FLAGS, *flags, str(src), "-o", str(out / "k.o")], check=True)
    subprocess.run(["cc", str(out / "k.o"), "-o", str(out / "k.so"), *LINK_FLAGS], check=True)
    lib = ctypes.CDLL(str(out / "k.so"))
    lib.int16_kernel_kind.restype = INT
    assert lib.int16_kernel_kind() == kind
    for k in ("q4", "q8"):
        getattr(lib, f"{k}_linear_f32").argtypes = [P, I64, I64, P, P, INT, P, P, I64, INT]
        getattr(lib, f"{k}_dequant_f32").argtypes = [P, P, INT, I64, P, I64, P]
    return lib


def _weight(kind: str, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    """Random codes, scales that fp16 holds (so packed in fp16)."""
    if kind == "q4":
        codes = torch.from_numpy(rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8))
        scales = torch.from_numpy(rng.standard_normal((n, k // 32, 2)).astype(np.float16))
    else:
        codes = torch.from_numpy(rng.integers(-128, 128, size=(n, k), dtype=np.int8))
        scales = torch.from_numpy(rng.standard_normal((n, k // 32)).astype(np.float16))
    w = QuantWeight.pack(kind, codes, scales.float())
    assert w.half
    return w


def _linear(
    lib: ctypes.CDLL,
    w: QuantWeight,
    scales: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor,
    exact: bool,
) -> torch.Tensor:
    n, k = w.shape
    y = torch.empty(x.shape[0], n)
    fn = getattr(lib, f"{w.kind}_linear_f32")
    half = int(scales.dtype == torch.float16)
    args = (x.data_ptr(), x.shape[0], k, w.codes.data_ptr(), scales.data_ptr(), half)
    assert fn(*args, bias.data_ptr(), y.data_ptr(), n, int(exact)) == 0
    return y


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_other_builds_compute_what_the_native_one_does(variant: ctypes.CDLL, kind: str) -> None:
    """Dequantized rows equal the native build's bit for bit; the linear (exact and int16
    activations, every tile size, a padded last block) agrees with the native build to
    rounding, and gives the same bits with the scales in fp16 as in fp32."""
    rng = np.random.default_rng(1)
    n, k = 40, 128
    w = _weight(kind, n, k, rng)
    ids = torch.arange(n)
    out = torch.empty(n, k)
    dq = getattr(variant, f"{kind}_dequant_f32")
    dq(w.codes.data_ptr(), w.scales.data_ptr(), 1, k, ids.data_ptr(), n, out.data_ptr())
    assert torch.equal(out, w.dequantize())
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    magnitude = w.dequantize().abs().T  # fp32 sums in another order: to that of the terms
    for rows in (1, 2, 3, 4, 5, 8, 9):
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
        tolerance = 1e-5 * (x.abs() @ magnitude + bias.abs()) + 1e-5
        for exact in (True, False):
            got = _linear(variant, w, w.scales, x, bias, exact)
            wide = _linear(variant, w, w.scales.float(), x, bias, exact)
            assert torch.equal(got, wide), (rows, exact)
            native = w.linear(x, bias, "fp32" if exact else "int16")
            assert ((got - native).abs() <= tolerance).all(), (rows, exact)
