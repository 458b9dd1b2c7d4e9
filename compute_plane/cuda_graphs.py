"""CUDA graphs of the decode forward, captured at start-up for padded batch sizes.

A decode step of n requests replays the graph of the smallest captured size b ≥ n.
Graphs read their inputs from static buffers; a replay first copies the step's
inputs into rows 0..n and makes rows n..b harmless padding:

    row        0 .. n-1            n .. b-1
    token      the step's          0
    position   the step's          0
    slot       the step's          0      (null block 0: written, never read)
    seq_len    the step's          1      (reads the null block's slot 0 only)
    table      the step's rows     row[0] = 0

Everything the kernels decide on the host is frozen at capture: the split-K count
is chosen for max_model_len, so it holds for any context a replay meets. Steps
with prefill tokens, more requests than the largest graph, or a block table wider
than max_model_len needs run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from compute_plane.attention import AttentionMetadata
from compute_plane.model import Model

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: Model,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        max_batch: int,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.max_blocks = -(-max_model_len // block_size)
        dev = model.device
        b = self.sizes[-1]
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.zeros(b, dtype=torch.long, device=dev)
        self.tables = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b],
            block_tables=self.tables[:b],
            seq_lens=[self.max_model_len] * b,  # host view: sizes the split-K count
            query_lens=[1] * b,
            num_decodes=b,
            block_size=self.block_size,
            seq_lens_tensor=self.seq_lens[:b],
        )

    def _forward(self, b: int) -> torch.Tensor:
        return self.model.forward(
            self.input_ids[:b], self.positions[:b], self._meta(b), self.kv_layers
        )

    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool."""
        started = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):
            self._forward(b)  # compiles kernels and settles the allocator outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s",
            len(self.sizes), self.sizes[-1], time.perf_counter() - started,
        )  # fmt: skip

    def padded_size(self, meta: AttentionMetadata) -> int | None:
        """The graph a step can replay, or None when it must run eagerly."""
        n = len(meta.seq_lens)
        if meta.num_decodes != n or meta.block_tables.shape[1] > self.max_blocks:
            return None
        return next((b for b in self.sizes if b >= n and b in self.graphs), None)

    def run(
        self, b: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay graph `b` on the step's inputs; returns hidden states [n, hidden].

        The result is the graph's output buffer: valid until the next replay.
        """
        n = len(meta.seq_lens)
        w = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :w].copy_(meta.block_tables)
        lens = meta.seq_lens_tensor  # staged on the device by the model runner
        if lens is None:
            lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        self.seq_lens[:n].copy_(lens, non_blocking=True)
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].zero_()
            self.tables[n:b, 0] = 0
            self.seq_lens[n:b] = 1
        self.graphs[b].replay()
        return self.outputs[b][:n]
