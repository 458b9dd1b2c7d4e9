"""CUDA graphs of the forward, captured at start-up: whole decode steps, and the other
steps in pieces between their attentions.

**Decode graphs** (DecodeGraphs).

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
than max_model_len needs go to the piecewise graphs.

**Piecewise graphs** (PiecewiseGraphs), for the steps above (prefill chunks, mixed
prefill + decode steps) of at most --piecewise-graphs tokens. Attention is the one part
of a step whose launch depends on the step's shape (its sequences, their query lengths,
the decode split count); everything else sees only the token count. So at each padded
token count T the forward is captured as L + 1 graphs, cut at the L attention calls:

    piece 0      embedding, layer 0's norm, QKV, rotary + K/V write
    attention 0  eager: the step's real rows and metadata, into a static buffer
    piece 1      layer 0's output projection and MLP, layer 1 up to its K/V write
    ...
    piece L      layer L-1's output projection and MLP, the final norm

Rows n..T are padding as in a decode graph (token 0, position 0, slot 0): the pieces
compute them, attention never sees them. A step's launches drop from ~9 a layer
(kernels and their Python) to one graph replay and its attention's one or two.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from compute_plane.attention import AttentionMetadata
from compute_plane.model import Model

log = logging.getLogger(__name__)


def graph_token_sizes(max_tokens: int) -> list[int]:
    """The piecewise graphs' token counts: powers of two from 16, then max_tokens."""
    sizes = []
    t = 16
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return [*sizes, max_tokens] if max_tokens > 0 else []


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
        self.capture_s = 0.0  # how long capture() took (warm-up forwards included)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata.decodes(
            self.slots[:b],
            self.tables[:b],
            [self.max_model_len] * b,  # host view: sizes the split-K count
            self.block_size,
            self.seq_lens[:b],
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
        self.capture_s = time.perf_counter() - started
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s",
            len(self.sizes), self.sizes[-1], self.capture_s,
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


class PiecewiseGraphs:
    """The forward of steps of up to `max_tokens` tokens as graphs between attentions."""

    def __init__(
        self,
        model: Model,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        max_tokens: int,
        block_size: int,
    ) -> None:
        # (the Triton kernel set: its attention writes into a given buffer, and its
        # rotary kernel writes K/V inside the pieces)
        attend_into = getattr(model.attention, "attend", None)
        assert model.attend is not None and attend_into is not None, (
            "piecewise graphs need the Triton kernel set"
        )
        self._attend_into: Callable[..., torch.Tensor] = attend_into
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.sizes = graph_token_sizes(max_tokens)
        t = self.sizes[-1]
        dev = model.device
        self.input_ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.positions = torch.zeros(t, dtype=torch.long, device=dev)
        self.slots = torch.zeros(t, dtype=torch.long, device=dev)
        cfg = model.cfg
        # what each attention writes and the next piece reads (all sizes, all layers:
        # replays run one at a time, and piece i + 1 reads it before attention i + 1)
        self.attn_out = torch.zeros(
            (t, cfg.num_attention_heads, cfg.head_dim), dtype=model.dtype, device=dev
        )
        # the capture's own metadata: decode-shaped, read by nothing captured but the slots
        self._tables = torch.zeros((t, 1), dtype=torch.int32, device=dev)
        self._lens = torch.ones(t, dtype=torch.int32, device=dev)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # per size, per layer: (its queries, as piece i leaves them; K cache; V cache; window)
        self.calls: dict[
            int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]]
        ] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool: Any = None  # the graphs' memory pool (torch's handle), once there is one
        self._capturing = 0  # the size being captured
        self.capture_s = 0.0  # how long capture() took (warm-up forwards included)
        # per size, where its capture's time went (seconds): the warm-up forward and its
        # wait (`warm_s`), the captured forward (`capture_s`), and of that the time inside
        # torch's capture_begin/capture_end (`graph_api_s`: the capture's bookkeeping and
        # each piece's instantiation), the rest being the forward's own Python and launches
        self.capture_by_size: dict[int, dict[str, float]] = {}
        self._graph_api_s = 0.0

    def _capture_meta(self, t: int) -> AttentionMetadata:
        return AttentionMetadata.decodes(
            self.slots[:t], self._tables[:t], [1] * t, self.block_size, self._lens[:t]
        )

    def capture(self) -> None:
        """Capture every size, largest first, all pieces in one memory pool."""
        started = time.perf_counter()
        model = self.model
        stream = torch.cuda.Stream(model.device)  # (a capture needs a stream of its own)
        for t in reversed(self.sizes):
            warm = time.perf_counter()
            meta = self._capture_meta(t)
            # compiles and tunes the kernels at this size outside the capture
            model.forward(self.input_ids[:t], self.positions[:t], meta, self.kv_layers)
            torch.cuda.synchronize()
            begun = time.perf_counter()
            self._graph_api_s = 0.0
            stream.wait_stream(torch.cuda.current_stream(model.device))
            attend = model.attend
            model.attend = self._cut  # the forward's attention calls end one piece each
            self.pieces[t], self.calls[t] = [], []
            self._capturing = t
            try:
                with torch.cuda.stream(stream):
                    self._begin()
                    self.outputs[t] = model.forward(
                        self.input_ids[:t], self.positions[:t], meta, self.kv_layers
                    )
                    self._end()
            finally:
                model.attend = attend
            torch.cuda.current_stream(model.device).wait_stream(stream)
            self.capture_by_size[t] = {
                "warm_s": round(begun - warm, 4),
                "capture_s": round(time.perf_counter() - begun, 4),
                "graph_api_s": round(self._graph_api_s, 4),
            }
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        log.info(
            "captured piecewise CUDA graphs for steps of up to %d tokens (%d sizes, %d "
            "pieces each) in %.1f s: warm-up forwards %.1f s, torch's capture_begin/end %.1f s",
            self.sizes[-1], len(self.sizes), len(self.model.layers) + 1, self.capture_s,
            sum(s["warm_s"] for s in self.capture_by_size.values()),
            sum(s["graph_api_s"] for s in self.capture_by_size.values()),
        )  # fmt: skip

    def _begin(self) -> None:
        started = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self.pieces[self._capturing].append(graph)
        self._graph_api_s += time.perf_counter() - started

    def _end(self) -> None:
        started = time.perf_counter()
        graph = self.pieces[self._capturing][-1]
        graph.capture_end()
        if self._pool is None:
            self._pool = graph.pool()
        self._graph_api_s += time.perf_counter() - started

    def _cut(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        """model.attend while capturing: ends a piece, notes the call, starts the next
        piece, which reads the attention's output from attn_out."""
        self._end()
        self.calls[self._capturing].append((q, k_cache, v_cache, window))
        self._begin()
        return self.attn_out[: q.shape[0]]

    def padded_size(self, num_tokens: int) -> int | None:
        """The token count a step of `num_tokens` replays at, or None (eager)."""
        return next((t for t in self.sizes if t >= num_tokens and t in self.pieces), None)

    def run(
        self, t: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay size `t`'s pieces on the step's inputs, attention eagerly between them;
        returns hidden states [n, hidden], valid until the next replay."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        if t > n:
            self.input_ids[n:t].zero_()
            self.positions[n:t].zero_()
            self.slots[n:t].zero_()
        self.model.attention.prepare(meta)
        attend, out = self._attend_into, self.attn_out[:n]
        pieces = self.pieces[t]
        for graph, (q, k_cache, v_cache, window) in zip(pieces, self.calls[t], strict=False):
            graph.replay()
            attend(q[:n], k_cache, v_cache, meta, window, out=out)
        pieces[-1].replay()
        return self.outputs[t][:n]
