"""Size the KV pool on CUDA from measured memory: what is left after weights and activations.

    total × utilisation
      − memory this engine took (CUDA context if first, weights: free memory before − after)
      − activation peak of the largest step (one profiling forward)
      = bytes for KV blocks (never more than is free)

Memory held by other processes, or by another engine in this process, is not counted
against this engine's share (as vLLM does); it only limits what is free.

The profiling forward runs the largest step the compute plane accepts
(max_num_batched_tokens tokens over max_num_seqs prefill sequences, logits of each
sequence's last token) over a scratch cache just large enough to hold it.
"""

from __future__ import annotations

import logging

import torch

from compute_plane.attention import AttentionMetadata
from compute_plane.config import ComputeConfig
from compute_plane.kv_cache import KVCache, bytes_per_block
from compute_plane.model import Model

log = logging.getLogger(__name__)


def _profile_step(
    model: Model, block_size: int, num_tokens: int, num_seqs: int, max_len: int
) -> int:
    """Run the profiling forward; returns the bytes of its scratch KV cache."""
    seqs = max(1, min(num_seqs, num_tokens))
    per = min(max_len, -(-num_tokens // seqs))
    lens = [per] * seqs
    blocks_each = -(-per // block_size)
    cache = KVCache(model.cfg, seqs * blocks_each + 1, block_size, model.dtype,
                    model.device)  # fmt: skip
    dev = model.device
    tables = 1 + torch.arange(seqs * blocks_each, dtype=torch.int32, device=dev)
    tables = tables.view(seqs, blocks_each)
    pos = torch.arange(per, device=dev)
    slots = (tables[:, pos // block_size].long() * block_size + pos % block_size).reshape(-1)
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=lens,
        query_lens=lens,
        num_decodes=0,
        block_size=block_size,
    )
    ids = torch.zeros(seqs * per, dtype=torch.long, device=dev)
    hidden = model.forward(ids, pos.repeat(seqs), meta, cache.layers)
    model.logits(hidden[per - 1 :: per])
    return cache.nbytes


def num_blocks_from_free_memory(
    model: Model, config: ComputeConfig, max_model_len: int, free_before: int
) -> int:
    """KV blocks (null block included) that fit beside the model and its activation peak.

    `free_before`: free device memory before this engine put anything on the device.
    """
    device = model.device
    block_size = config.block_size
    utilization = config.gpu_memory_utilization
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    scratch = _profile_step(
        model, block_size, config.max_num_batched_tokens, config.max_num_seqs, max_model_len
    )
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = max(0, free_before - free)  # this engine's context, weights and tables
    margin = 256 << 20  # for the CUDA graphs' pool and the allocator's slack
    budget = min(int(total * utilization) - in_use - activations, free - activations - margin)
    per_block = bytes_per_block(model.cfg, block_size, model.dtype)
    n = budget // per_block
    log.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB activation peak; "
        "%.2f GiB for %d KV blocks at utilisation %.2f",
        total / 2**30, in_use / 2**30, activations / 2**30, max(budget, 0) / 2**30, n, utilization,
    )  # fmt: skip
    if n < 2:
        raise ValueError(
            f"no room for the KV cache: {total / 2**30:.2f} GiB × {utilization} − "
            f"{in_use / 2**30:.2f} GiB in use − {activations / 2**30:.2f} GiB of activations "
            f"leaves {budget / 2**30:.2f} GiB; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens"
        )
    return int(n)
