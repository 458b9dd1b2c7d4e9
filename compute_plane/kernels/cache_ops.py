"""KV-cache writes: new tokens' K/V into their slots, and whole-block copies.

On a CUDA device with CuPy these are CuPy RawKernels launched on torch's current
stream (so they order with the model's kernels and are captured by CUDA graphs);
anywhere else, or without CuPy, the same operations run as torch indexing. CuPy
compiles the kernels with NVRTC: `cupy_works` compiles every variant and runs each
kernel once, at the engine's warm-up (or the first use), and where that fails (no
NVRTC found, a GPU newer than the NVRTC, a driver too old) the torch path is used on
that device for the rest of the process, with one WARNING naming the cause.
The kernels move raw words, never interpret the values: one kernel serves every
dtype, with the word as wide as every offset's alignment allows (up to 16 bytes).

Cache layout (kv_cache.py): [num_blocks, block_size, KVH, D], contiguous, so slot s
of a layer starts at element s × KVH × D and block b at b × block_size × KVH × D.
"""

from __future__ import annotations

import functools
import logging
import math
from types import ModuleType
from typing import Any

import torch

log = logging.getLogger(__name__)

_WORDS = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short",
          1: "unsigned char"}  # fmt: skip

_WRITE_KV = r"""
typedef WORD word;
// One CUDA block per new token; threads stride over the token's KVH x D words.
extern "C" __global__ void write_kv(
    const word* __restrict__ k, const word* __restrict__ v,
    word* __restrict__ k_cache, word* __restrict__ v_cache,
    const long long* __restrict__ slots,
    long long k_tok, long long k_head, long long v_tok, long long v_head,
    int num_heads, int head_words) {
  const long long t = blockIdx.x;
  const int n = num_heads * head_words;
  const long long dst = slots[t] * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / head_words, w = i - h * head_words;
    k_cache[dst + i] = k[t * k_tok + h * k_head + w];
    v_cache[dst + i] = v[t * v_tok + h * v_head + w];
  }
}
"""

_COPY_BLOCKS = r"""
typedef WORD word;
// grid (pair, cache): copy block pairs[2p] onto block pairs[2p + 1] in cache y.
extern "C" __global__ void copy_blocks(
    const long long* __restrict__ caches, const long long* __restrict__ pairs,
    long long block_words) {
  word* cache = reinterpret_cast<word*>(caches[blockIdx.y]);
  const long long src = pairs[2 * blockIdx.x] * block_words;
  const long long dst = pairs[2 * blockIdx.x + 1] * block_words;
  for (long long i = threadIdx.x; i < block_words; i += blockDim.x) {
    cache[dst + i] = cache[src + i];
  }
}
"""


@functools.cache
def _cupy() -> ModuleType | None:
    """CuPy when it is installed and sees a GPU, else None (the torch path is used)."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        if cupy.cuda.is_available():
            return cupy
    except Exception:  # a broken driver install: fall back rather than fail
        log.exception("CuPy is installed but cannot use CUDA; KV writes use torch")
    return None


def uses_cupy(t: torch.Tensor) -> bool:
    """Whether cache ops on `t` run as CuPy kernels."""
    return t.is_cuda and cupy_works(t.device)


def cupy_works(device: torch.device) -> bool:
    """Whether the CuPy kernels run on CUDA `device`: CuPy sees a GPU, NVRTC compiles
    every variant and each kernel, launched once on tiny tensors, gives torch's result.
    Checked once per device and process (the engine's warm-up asks first, before any
    step or graph capture); where not, one WARNING names the cause and the cache ops on
    `device` use torch from then on."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cupy_works(index)


@functools.cache
def _cupy_works(index: int) -> bool:
    if _cupy() is None:
        return False
    try:
        _check(torch.device("cuda", index))
    except Exception as e:
        cause = (str(e).strip().splitlines() or [""])[0]
        log.warning(
            "CuPy's KV-cache kernels do not work on cuda:%d (%s: %s); KV-cache writes and "
            "block copies there use torch for the rest of this process. CuPy needs NVRTC "
            "(libnvrtc.so.12 from the nvidia-cuda-nvrtc-cu12 package, or a CUDA toolkit's) "
            "that supports this GPU: see docs/deployment.md",
            index, type(e).__name__, cause,
        )  # fmt: skip
        return False
    return True


def _check(device: torch.device) -> None:
    """Raise unless every kernel variant compiles and loads on `device`, and write_kv and
    copy_blocks, launched once, agree with torch's indexing."""
    cupy = _cupy()
    assert cupy is not None
    with cupy.cuda.Device(device.index):
        for name in ("write_kv", "copy_blocks"):
            for word in _WORDS:
                _kernel(name, word).compile()  # NVRTC, then the module loaded on the GPU
    k = torch.arange(1, 17, dtype=torch.float32, device=device).view(2, 2, 4)  # [T, KVH, D]
    v = -k
    kc, vc = torch.zeros(3, 2, 2, 4, device=device), torch.zeros(3, 2, 2, 4, device=device)
    slots = torch.tensor([3, 0], device=device)  # block 1's second slot, block 0's first
    _write_kv_cupy(k, v, kc, vc, slots)
    _copy_blocks_cupy([(kc, vc)], [1], [2])
    for cache, new in ((kc, k), (vc, v)):
        want = torch.zeros_like(cache)
        want.view(-1, 2, 4).index_copy_(0, slots, new)
        want[2] = want[1]
        if not torch.equal(cache, want):
            raise RuntimeError("the kernels' results differ from torch's indexing")


@functools.cache
def _kernel(name: str, word_bytes: int) -> Any:
    cupy = _cupy()
    assert cupy is not None
    src = {"write_kv": _WRITE_KV, "copy_blocks": _COPY_BLOCKS}[name]
    return cupy.RawKernel(src.replace("WORD", _WORDS[word_bytes]), name)


def _word_bytes(*byte_counts: int) -> int:
    """The widest word that divides every offset (and pointer) in bytes."""
    g = 0
    for b in byte_counts:
        g = math.gcd(g, b)
    return next(w for w in (16, 8, 4, 2, 1) if g % w == 0)


class _StreamHandle:
    """A raw cudaStream_t as the CUDA stream protocol (`__cuda_stream__`) that CuPy's
    `Stream.from_external` takes."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(cupy: Any, ptr: int, device: int) -> Any:
    """torch's stream `ptr` as a CuPy stream on `device`: `Stream.from_external` (call it
    inside `cupy.cuda.Device(device)`: the protocol carries no device), or on CuPy
    releases without it `ExternalStream`, which newer ones deprecate."""
    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device)


def _launch(
    t: torch.Tensor, name: str, word: int, grid: tuple[int, ...], args: tuple[Any, ...]
) -> None:
    cupy = _cupy()
    assert cupy is not None
    ptr = torch.cuda.current_stream(t.device).cuda_stream
    with cupy.cuda.Device(t.device.index), cupy_stream(cupy, ptr, t.device.index):
        _kernel(name, word)(grid, (128,), args)


def write_kv(
    k: torch.Tensor,  # [T, KVH, D], last dim contiguous (may be a view into the qkv output)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [N, bs, KVH, D] contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 (padding tokens write to the null block's slots)
) -> None:
    """k_cache/v_cache at slot_mapping[t] ← k[t]/v[t] (the slot-mapping scatter)."""
    t, kvh, d = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1 and slot_mapping.dtype == torch.int64
    if t == 0:
        return
    if not uses_cupy(k_cache):
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)
        return
    _write_kv_cupy(k, v, k_cache, v_cache, slot_mapping)


def _write_kv_cupy(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    t, kvh, d = k.shape
    es = k.element_size()
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    word = _word_bytes(
        d * es, *(s * es for s in strides),
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
    )  # fmt: skip
    per = word // es
    _launch(k, "write_kv", word, (t,), (
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), *(s // per for s in strides),
        _i32(kvh), _i32(d // per),
    ))  # fmt: skip


def copy_blocks(
    caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V), [N, bs, KVH, D]
    src: list[int],
    dst: list[int],
) -> None:
    """Block dst[i] ← block src[i] in every layer's K and V (copy-on-write of a shared block).

    The caller guarantees no block is both a source and a destination, and no
    destination repeats, so the copies may run in any order.
    """
    assert len(src) == len(dst)
    if not src or not caches:
        return
    first = caches[0][0]
    if not uses_cupy(first):
        s = torch.tensor(src, dtype=torch.long, device=first.device)
        d = torch.tensor(dst, dtype=torch.long, device=first.device)
        for k, v in caches:
            k.index_copy_(0, d, k.index_select(0, s))
            v.index_copy_(0, d, v.index_select(0, s))
        return
    _copy_blocks_cupy(caches, src, dst)


def _copy_blocks_cupy(
    caches: list[tuple[torch.Tensor, torch.Tensor]], src: list[int], dst: list[int]
) -> None:
    first = caches[0][0]
    flat = [c for kv in caches for c in kv]
    assert all(c.is_contiguous() and c.shape == first.shape for c in flat)
    block_bytes = first[0].numel() * first.element_size()
    word = _word_bytes(block_bytes, *(c.data_ptr() for c in flat))
    ptrs = torch.tensor([c.data_ptr() for c in flat], dtype=torch.int64, device=first.device)
    pairs = torch.tensor([x for p in zip(src, dst, strict=True) for x in p], dtype=torch.int64,
                         device=first.device)  # fmt: skip
    _launch(first, "copy_blocks", word, (len(src), len(flat)),
            (ptrs.data_ptr(), pairs.data_ptr(), block_bytes // word))  # fmt: skip


def _i32(x: int) -> Any:
    import numpy as np

    return np.int32(x)
