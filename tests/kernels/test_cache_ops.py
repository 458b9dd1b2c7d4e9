"""KV-cache scatter and block copies against plain loops; CuPy kernels on a GPU."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

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


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """cache_ops' per-process answers (CuPy, its kernels, whether they work) forgotten
    before and after: a test that makes them fail leaves nothing behind."""

    def forget() -> None:
        for f in (cache_ops._cupy, cache_ops._kernel, cache_ops._cupy_works):
            f.cache_clear()

    forget()
    yield
    forget()


def test_kernels_that_fail_to_compile_leave_the_torch_path_and_one_warning(
    fresh_probe: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CUDA image's CuPy without NVRTC (or an NVRTC older than the GPU): the check the
    engine's warm-up runs fails, so one WARNING names the cause and the cache ops on that
    device take torch's path for the rest of the process, never failing a step. (A
    stand-in for CuPy whose kernels cannot compile: no GPU is needed.)"""
    from types import SimpleNamespace

    compiles: list[str] = []

    class RawKernel:
        def __init__(self, src: str, name: str) -> None:
            self.name = name

        def compile(self) -> None:
            compiles.append(self.name)
            raise RuntimeError(
                "CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open "
                "shared object file: No such file or directory\n(more lines)"
            )

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    fake = SimpleNamespace(RawKernel=RawKernel, cuda=SimpleNamespace(Device=Device))
    monkeypatch.setattr(cache_ops, "_cupy", functools.cache(lambda: fake))
    caplog.set_level(logging.WARNING, logger=cache_ops.__name__)
    on_gpu = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))

    assert not cache_ops.cupy_works(torch.device("cuda", 0))
    assert not cache_ops.uses_cupy(on_gpu)  # type: ignore[arg-type]
    assert not cache_ops.cupy_works(torch.device("cuda", 0))
    assert compiles == ["write_kv"]  # checked once: the first compile failed
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "CuPy's KV-cache kernels do not work on cuda:0 (RuntimeError: CuPy failed to load "
        "libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open shared object file: No such "
        "file or directory); KV-cache writes and block copies there use torch"
    )


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_GPU, id="cuda")])
def test_a_kernel_that_does_not_compile_on_the_gpu_leaves_the_torch_path(
    _: None, fresh_probe: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The same through the real CuPy and NVRTC: a kernel source NVRTC refuses gives the
    warning, and write_kv and copy_blocks still write the right values (torch's path)."""
    pytest.importorskip("cupy")
    monkeypatch.setattr(cache_ops, "_COPY_BLOCKS", cache_ops._COPY_BLOCKS + "\nnot C++")
    caplog.set_level(logging.WARNING, logger=cache_ops.__name__)
    assert not cache_ops.uses_cupy(torch.empty(1, device="cuda"))
    assert "CompileException" in caplog.text
    test_write_kv_from_strided_views(torch.bfloat16)
    test_copy_blocks_every_layer(torch.bfloat16)


@pytest.mark.parametrize("_", [pytest.param(None, marks=ON_GPU, id="cuda")])
def test_the_cupy_check_passes_on_the_gpu(
    _: None, fresh_probe: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Every variant compiles with the NVRTC CuPy finds here, loads on this GPU and agrees
    with torch: no warning."""
    pytest.importorskip("cupy")
    caplog.set_level(logging.WARNING, logger=cache_ops.__name__)
    assert cache_ops.cupy_works(torch.device("cuda", torch.cuda.current_device()))
    assert not caplog.records
