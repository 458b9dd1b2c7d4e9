"""KV-cache scatter and block copies against plain loops; CuPy kernels on a GPU."""

from __future__ import annotations

import pytest
import torch

from compute_plane.kernels import cache_ops
from tests.kernels.reference import DEVICE, ON_GPU

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _caches(n: int, bs: int, kvh: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, bs, kvh, d).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_from_strided_views(dtype: torch.dtype) -> None:
    """k and v as the model hands them over: views into one fused qkv row per token."""
    t, h, kvh, d, bs = 5, 4, 2, 80, 8
    qkv = torch.randn(t, (h + 2 * kvh) * d).to(DEVICE, dtype)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    kc, vc = _caches(6, bs, kvh, d, dtype), _caches(6, bs, kvh, d, dtype)
    before_k, before_v = kc.clone(), vc.clone()
    slots = [3 * bs + 7, 1 * bs + 0, 5 * bs + 2, 2 * bs + 5, 4 * bs + 1]
    cache_ops.write_kv(k, v, kc, vc, torch.tensor(slots, device=DEVICE))
    for i, s in enumerate(slots):
        before_k[s // bs, s % bs] = k[i]
        before_v[s // bs, s % bs] = v[i]
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_every_layer(dtype: torch.dtype) -> None:
    layers = [(_caches(7, 4, 2, 16, dtype), _caches(7, 4, 2, 16, dtype)) for _ in range(3)]
    expected = [(k.clone(), v.clone()) for k, v in layers]
    src, dst = [2, 5, 1], [6, 3, 4]
    cache_ops.copy_blocks(layers, src, dst)
    for k, v in expected:
        for s, d in zip(src, dst, strict=True):
            k[d], v[d] = k[s].clone(), v[s].clone()
    for (k, v), (ek, ev) in zip(layers, expected, strict=True):
        assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_GPU, id="cuda")])
def test_cupy_kernels_are_used_on_cuda(_: None) -> None:
    pytest.importorskip("cupy")
    assert cache_ops.uses_cupy(torch.empty(1, device="cuda"))


def test_cupy_stream_uses_the_stream_protocol_where_cupy_has_it() -> None:
    """CuPy deprecates ExternalStream for Stream.from_external(obj with __cuda_stream__):
    the handle handed over carries torch's raw stream; older CuPy gets ExternalStream with
    the device. (CuPy's own classes are replaced by recorders: no GPU is needed.)"""
    from types import SimpleNamespace

    got: list[object] = []

    class NewStream:
        @staticmethod
        def from_external(obj: object) -> str:
            got.append(obj.__cuda_stream__())  # type: ignore[attr-defined]
            return "from_external"

    new = SimpleNamespace(cuda=SimpleNamespace(Stream=NewStream))
    assert cache_ops.cupy_stream(new, 0xABC, 1) == "from_external"
    assert got == [(0, 0xABC)]

    def external(ptr: int, device: int) -> tuple[int, int]:
        return (ptr, device)

    old = SimpleNamespace(cuda=SimpleNamespace(Stream=object, ExternalStream=external))
    assert cache_ops.cupy_stream(old, 0xABC, 1) == (0xABC, 1)
