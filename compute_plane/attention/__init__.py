"""Attention over the paged KV cache, one package: the metadata every backend reads, the
backends, and the factory that picks one.

    torch_backend.py   AttentionMetadata, the backend protocol, the torch reference
                       (gather + SDPA; any device and dtype)
    cpu.py             the C decode kernel over the blocks in place (CPU, float32)
    triton_backend.py  the Triton kernels (CUDA; on the CPU under TRITON_INTERPRET=1)
    factory.py         `auto` resolved per device and dtype; the model's kernel set

The kernels themselves (Triton, CuPy) live in compute_plane/kernels/, beside the
non-attention ones (RMSNorm, rotary, KV-cache writes) they share a module with.
"""

from compute_plane.attention.torch_backend import (
    AttentionBackend,
    AttentionMetadata,
    TorchPagedAttention,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention"]
