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
from typing import Protocol

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
    decode_blocks: torch.Tensor | None = None  # [D * nb] the decodes' block tables, 0-padded
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, nb * block_size] valid positions
    # (first row, end row, blocks to gather, mask) of each prefill chunk; blocks and mask
    # are None for a chunk with no cached prefix (it attends to its own K/V, causally).
    prefill_spans: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )
    # Derived by the Triton backend's prepare() (triton_backend.py). seq_lens_tensor may
    # be given instead: CUDA graphs pass a static buffer that replays overwrite.
    seq_lens_tensor: torch.Tensor | None = None  # [B] int32, on the device
    query_start_loc: torch.Tensor | None = None  # [P + 1] int32: prefill chunks' query rows
    num_splits: int = 1  # split-K parts of each decode's context
    # Per sliding window: the torch backend's masks for layers that see only the last
    # `window` positions, derived on first use in a step (attention.torch_backend).
    windowed: dict[int, object] = field(default_factory=dict)

    @classmethod
    def decodes(
        cls,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: list[int],
        block_size: int,
        seq_lens_tensor: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """A step of decodes only: one query token per sequence."""
        n = len(seq_lens)
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_lens=[1] * n,
            num_decodes=n,
            block_size=block_size,
            seq_lens_tensor=seq_lens_tensor,
        )


class AttentionBackend(Protocol):
    """What the model calls: prepare() once per step, forward() once per layer."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write k/v at meta.slot_mapping, then attend; q [T, H, D] -> [T, H, D]. With a
        `window`, a query at position p sees keys at positions p - window + 1 .. p."""
        ...


Span = tuple[int, int, torch.Tensor | None, torch.Tensor | None]


class TorchPagedAttention:
    """Reference backend: gathers each request's context blocks and runs SDPA.

    Whole blocks are gathered (one index_select of block ids, ~3x cheaper than indexing
    slot by slot); positions past a request's context are masked. Decodes are batched
    into one SDPA call (padded to the longest context); each prefill chunk gets its own
    call with a causal mask offset by its prefix.
    """

    name = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step gather indices and masks, shared by all layers."""
        if meta.num_decodes:
            self.prepare_decodes(meta)
        self.prepare_prefills(meta)

    def prepare_decodes(self, meta: AttentionMetadata) -> None:
        dev = meta.slot_mapping.device
        bs = meta.block_size
        d = meta.num_decodes
        nb = (max(meta.seq_lens[:d]) + bs - 1) // bs
        meta.decode_blocks = meta.block_tables[:d, :nb].long().reshape(-1)
        pos = torch.arange(nb * bs, device=dev)
        lens = torch.tensor(meta.seq_lens[:d], device=dev)
        meta.decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]

    def prepare_prefills(self, meta: AttentionMetadata) -> None:
        dev = meta.slot_mapping.device
        bs = meta.block_size
        spans: list[Span] = []
        start = d = meta.num_decodes
        for i in range(d, len(meta.seq_lens)):
            ctx, q = meta.seq_lens[i], meta.query_lens[i]
            if ctx == q:  # nothing cached before this chunk
                spans.append((start, start + q, None, None))
                start += q
                continue
            nb = (ctx + bs - 1) // bs
            blocks = meta.block_tables[i, :nb].long()
            pos = torch.arange(nb * bs, device=dev)
            q_pos = torch.arange(ctx - q, ctx, device=dev)
            mask = pos[None, :] <= q_pos[:, None]  # [q, nb*bs] causal, full to the prefix
            spans.append((start, start + q, blocks, mask))
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
        window: int | None = None,
    ) -> torch.Tensor:
        kvh, hd = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, kvh, hd)
        v_flat = v_cache.view(-1, kvh, hd)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.num_decodes
        if d:
            out[:d] = self.decode(q[:d], k_cache, v_cache, meta, window)
        spans = meta.prefill_spans if window is None else self._windowed(meta, window)[1]
        for start, end, blocks, mask in spans:
            qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
            if blocks is None:
                # No prefix: the chunk's own K/V, causal. SDPA's fused causal kernel,
                # with no gather and no mask (a 2048-token prompt's attention ~1.8x faster);
                # a mask only where a sliding window is shorter than the chunk.
                keys = k[start:end].transpose(0, 1).unsqueeze(0)
                vals = v[start:end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qp, keys, vals, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                    enable_gqa=True,
                )  # fmt: skip
            else:
                keys = k_cache.index_select(0, blocks).view(-1, kvh, hd)
                vals = v_cache.index_select(0, blocks).view(-1, kvh, hd)
                o = F.scaled_dot_product_attention(
                    qp,
                    keys.transpose(0, 1).unsqueeze(0),
                    vals.transpose(0, 1).unsqueeze(0),
                    attn_mask=mask,
                    scale=self.scale,
                    enable_gqa=True,
                )
            out[start:end] = o.squeeze(0).transpose(0, 1)
        return out

    def _windowed(
        self, meta: AttentionMetadata, window: int
    ) -> tuple[torch.Tensor | None, list[Span]]:
        """The step's decode mask and prefill spans for layers with this sliding window
        (keys at positions > query position - window), derived once per step."""
        got = meta.windowed.get(window)
        if got is None:
            decode_mask = meta.decode_mask
            if decode_mask is not None:
                pos = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
                lens = meta.seq_lens[: meta.num_decodes]
                first = torch.tensor(lens, device=pos.device) - window
                decode_mask = decode_mask & (pos[None, :] >= first[:, None])[:, None, None, :]
            spans = [self._window_span(meta, i, span, window) for i, span in
                     enumerate(meta.prefill_spans)]  # fmt: skip
            got = meta.windowed[window] = (decode_mask, spans)
        return got  # type: ignore[return-value]

    @staticmethod
    def _window_span(meta: AttentionMetadata, i: int, span: Span, window: int) -> Span:
        start, end, blocks, mask = span
        q = end - start
        ctx = meta.seq_lens[meta.num_decodes + i]
        q_pos = torch.arange(ctx - q, ctx, device=meta.slot_mapping.device)
        if mask is None:  # no prefix: keys are the chunk's own tokens
            if q <= window:
                return span  # causal alone keeps every key within the window
            k_pos = q_pos
            mask = k_pos[None, :] <= q_pos[:, None]
        else:
            k_pos = torch.arange(mask.shape[1], device=mask.device)
        return start, end, blocks, mask & (k_pos[None, :] > q_pos[:, None] - window)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        """The decodes' attention, q [D, H, hd] -> [D, H, hd]: one padded, masked SDPA."""
        d, kvh, hd = q.shape[0], k_cache.shape[2], k_cache.shape[3]
        blocks = meta.decode_blocks
        assert blocks is not None, "prepare() first"
        mask = meta.decode_mask if window is None else self._windowed(meta, window)[0]
        keys = k_cache.index_select(0, blocks).view(d, -1, kvh, hd).transpose(1, 2)
        vals = v_cache.index_select(0, blocks).view(d, -1, kvh, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [D, H, 1, hd]
            keys,
            vals,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)
