"""Attention over a paged KV cache: the step's metadata and the torch (CPU) backend.

KV layout, per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`;
token t of a request lives in slot `block_table[t // block_size] * block_size + t % block_size`.

A step's batch is ragged and flattened to T tokens. Requests are ordered decodes
first (one query token each), then prefill chunks (any number of query tokens, which
attend causally within the chunk and fully to the prefix already in the cache):

    tokens: [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]      num_decodes = 3
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    block_tables: torch.Tensor  # [B, max_blocks] int32, 0-padded
    seq_lens: list[int]  # [B] context length after this step (cached prefix + new tokens)
    query_lens: list[int]  # [B] tokens computed this step
    num_decodes: int  # the first num_decodes requests have query_len == 1
    block_size: int
    # Derived by the torch backend's prepare(), once per step, shared by all layers.
    decode_slots: torch.Tensor | None = None  # [D, max_ctx] context slots of each decode
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_ctx] valid context positions
    prefill_spans: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class TorchPagedAttention:
    """Reference backend: gathers each request's context slots and runs SDPA.

    Decodes are batched into one SDPA call (padded to the longest context, masked);
    each prefill chunk gets its own call with a causal mask offset by its prefix.
    """

    name = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step gather indices and masks, shared by all layers."""
        dev = meta.slot_mapping.device
        bs = meta.block_size
        d = meta.num_decodes
        if d:
            max_ctx = max(meta.seq_lens[:d])
            pos = torch.arange(max_ctx, device=dev)
            tables = meta.block_tables[:d, : (max_ctx + bs - 1) // bs].long()
            slots = tables[:, pos // bs] * bs + pos % bs  # [D, max_ctx]
            lens = torch.tensor(meta.seq_lens[:d], device=dev)
            meta.decode_slots = slots
            meta.decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]
        spans: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        start = d
        for i in range(d, len(meta.seq_lens)):
            ctx, q = meta.seq_lens[i], meta.query_lens[i]
            pos = torch.arange(ctx, device=dev)
            slots = meta.block_tables[i, pos // bs].long() * bs + pos % bs
            q_pos = torch.arange(ctx - q, ctx, device=dev)
            mask = pos[None, :] <= q_pos[:, None]  # [q, ctx] causal, full to the prefix
            spans.append((start, start + q, slots, mask))
            start += q
        meta.prefill_spans = spans

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [N, bs, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        kvh, hd = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, kvh, hd)
        v_flat = v_cache.view(-1, kvh, hd)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            slots = meta.decode_slots
            assert slots is not None, "prepare() first"
            keys = k_flat[slots].transpose(1, 2)  # [D, KVH, ctx, hd]
            vals = v_flat[slots].transpose(1, 2)
            qd = q[:d].unsqueeze(2)  # [D, H, 1, hd]
            o = F.scaled_dot_product_attention(
                qd,
                keys,
                vals,
                attn_mask=meta.decode_mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[:d] = o.squeeze(2)
        for start, end, slots, mask in meta.prefill_spans:
            keys = k_flat[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, hd]
            vals = v_flat[slots].transpose(0, 1).unsqueeze(0)
            qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
            o = F.scaled_dot_product_attention(
                qp, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            out[start:end] = o.squeeze(0).transpose(0, 1)
        return out
