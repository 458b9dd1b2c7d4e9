"""KV cache memory: per layer one K and one V tensor of shape [num_blocks, block_size, KVH, D]."""

from __future__ import annotations

import math
import mmap

import torch

from compute_plane.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer, for one block of tokens."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_blocks_for_budget(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    budget: int,
    draft: ModelConfig | None = None,
) -> int:
    """How many blocks (null block 0 included) fit in `budget` bytes (--kv-cache-bytes),
    with a `draft` model's cache holding as many blocks beside; at least 2 are needed."""
    per_block = bytes_per_block(cfg, block_size, dtype)
    if draft is not None:
        per_block += bytes_per_block(draft, block_size, dtype)
    n = budget // per_block
    if n < 2:
        also = " (the draft model's included)" if draft is not None else ""
        raise ValueError(
            f"--kv-cache-bytes {budget} holds {n} block(s) of {per_block} bytes{also}; "
            f"at least 2 are needed: --kv-cache-bytes >= {2 * per_block}"
        )
    return int(n)


class KVCache:
    """The cache tensors. Block 0 is the null block: never allocated by the control plane."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(cfg.num_layers)
        ]
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in self.layers)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in an anonymous mapping: the kernel hands out zero pages as they
    are first written, so the pool costs neither start-up time nor resident memory until
    its blocks are used (torch.zeros writes every page: 0.4-0.8 s and 1 GiB resident for
    the default CPU pool before the first request). Page-aligned, contiguous; the tensor
    keeps the mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:  # mmap refuses an empty mapping
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        pool = mmap.mmap(-1, nbytes)
    except OSError as e:  # ENOMEM: more than the kernel will promise (overcommit)
        raise ValueError(
            f"kv_cache_bytes: cannot map {nbytes} bytes for a KV cache tensor ({e.strerror}); "
            "lower --kv-cache-bytes"
        ) from None
    return torch.frombuffer(pool, dtype=dtype).view(shape)
