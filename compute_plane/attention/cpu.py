"""The CPU backend: decode attention by a C kernel that reads K/V where they lie in the cache.

The torch backend gathers every decode's context blocks into a padded copy and runs a
masked SDPA; on a CPU that copy is most of a decode step (docs/performance.md). The
kernel in `csrc/paged_attention_cpu.c` walks each sequence's block table instead, on
torch's OpenMP threads (ctypes releases the GIL during the call).
Prefill chunks keep the torch path: a chunk's many query tokens amortise its gather.

The kernel is plain C (fp32 only), compiled with the system's C compiler on first use
and cached (compute_plane/native.py). `--attention-backend auto` picks it on a CPU for fp32 and falls
back to the torch backend, with a warning, where no compiler is found.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from compute_plane.attention.torch_backend import AttentionMetadata, TorchPagedAttention
from compute_plane.native import KernelUnavailable, load_library

__all__ = ["CPUPagedAttention", "KernelUnavailable", "load_kernel"]


@functools.cache
def load_kernel() -> Callable[..., int]:
    """The compiled kernel's entry point (compute_plane.native builds and caches it)."""
    fn = load_library("paged_attention_cpu").paged_decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64]
    fn.restype = ctypes.c_int
    return fn


class CPUPagedAttention(TorchPagedAttention):
    """Decodes by the C kernel; prefill chunks as the torch backend."""

    name = "cpu"

    def __init__(self, scale: float) -> None:
        super().__init__(scale)
        self._kernel = load_kernel()

    def prepare_decodes(self, meta: AttentionMetadata) -> None:
        meta.seq_lens_tensor = torch.tensor(meta.seq_lens[: meta.num_decodes], dtype=torch.int32)
        if meta.block_tables.dtype != torch.int32 or not meta.block_tables.is_contiguous():
            meta.block_tables = meta.block_tables.to(torch.int32).contiguous()

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        if not (k_cache.dtype == v_cache.dtype == q.dtype == torch.float32):
            raise TypeError(f"the CPU attention kernel is fp32 only, got {k_cache.dtype}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the CPU attention kernel needs contiguous KV caches")
        lens = meta.seq_lens_tensor
        assert lens is not None, "prepare() first"
        q = q.contiguous()
        out = torch.empty_like(q)
        tables = meta.block_tables
        d, heads, head_dim = q.shape
        with torch.profiler.record_function("cpu_decode_attention"):
            failed = self._kernel(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                tables.stride(0), lens.data_ptr(), out.data_ptr(), d, heads,
                k_cache.shape[2], head_dim, k_cache.shape[1], self.scale, window or 0,
            )  # fmt: skip
        if failed:
            raise MemoryError("the CPU attention kernel could not allocate its score buffers")
        return out
