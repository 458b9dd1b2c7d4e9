"""The model runner: prepare a step's inputs -> forward -> sample (nano-vllm's
model_runner.py). Tensor building lives here and only here.

A step's integers are written into host buffers allocated once, for the configured
step size (a larger step grows them once), through numpy views of the same memory:

    tokens  (int64)  [ ids | positions | slots | sampled rows | pending: at, from ]
                       n     n           n       s              f     f
    ints    (int32)  [ block tables, the step's width | seq_lens | prefill query starts ]

On the CPU the step's tensors are views of these buffers. On a GPU the buffers are
pinned and mirrored by device buffers of the same layout: a step is two asynchronous
copies of the used prefixes and no allocation, and the tensors it passes on are views
of the device buffers (attention's lengths and query starts included, so the backend
copies nothing more). Before rewriting the host buffers a step waits for the last
step's copies to have left them (an event: the GPU may still be behind).

Overlapped steps (`Engine.launch`): a step can leave its samples on the device
(`DeviceSamples`, copied to the host behind the forward) while the next step is prepared
and launched. The requests' last tokens are then PENDING in their
states; `prepare` takes them from the earlier step's device tensor (the `pending`
entries: positions in the ids, and rows of that tensor), gathered on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from compute_plane.attention import AttentionMetadata
from compute_plane.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from compute_plane.kv_cache import KVCache
from compute_plane.model import Model
from compute_plane.requests import RequestState, Row
from compute_plane.sampler import DeviceSamples, HostCopy, SampleOutput, sample_on_device, to_device
from hetero_proto import compute_pb2 as pb

PENDING = -1  # a request's last token while its sample is on the device (Engine.launch)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[Row]  # rows whose last token is sampled, in order
    # Their last token's row in the hidden states (a row with a proposal of k tokens:
    # its last k + 1 tokens' rows, each sampled as the row would be at that position).
    sample_index: torch.Tensor


@dataclass
class StepOutput:
    sampled: SampleOutput | None  # None when no row samples (prefill chunks only)
    num_tokens: int
    forward_ns: int
    sample_ns: int
    logits_by_row: list[torch.Tensor] | None = None  # with capture_logits: every token's
    prompt_logprobs: PromptLogprobs | None = None  # of the rows that asked for them
    prepare_ns: int = 0  # building the step's inputs
    sample_rows: list[Row] = field(default_factory=list)  # rows that sampled, in order
    # run(defer=True) without proposals: the samples, still on the device (`sampled` is
    # None); each sampling row's last token is PENDING until the engine takes them.
    deferred: DeviceSamples | None = None
    # Deferred on CUDA: events before the forward, after it and after sampling (the host
    # times above then only cover queueing the work; these time it on the device).
    device_times: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | None = None


@dataclass(eq=False)
class PromptLogprobs:
    """A step's prompt logprobs (rows that asked), their copy to the host queued."""

    asked: list[tuple[str, int, list[int], int]]  # request, first position, targets, top k
    copy: HostCopy  # per row: logprobs [n], ranks [n], top values [n, k], top ids [n, k]

    def messages(self) -> list[pb.PromptLogprobs]:
        values = self.copy.lists()
        out = []
        for j, (rid, start, targets, k) in enumerate(self.asked):
            lps, ranks, top_vals, top_ids = values[4 * j : 4 * j + 4]
            msg = pb.PromptLogprobs(request_id=rid, start=start)
            for i, (t, v, rank) in enumerate(zip(targets, lps, ranks, strict=True)):
                tr = msg.tokens.add(token_id=t, logprob=v, rank=rank)
                if k:
                    for tid, tv in zip(top_ids[i], top_vals[i], strict=True):
                        tr.top_logprobs.add(token_id=tid, logprob=tv)
            out.append(msg)
        return out


class BlockTables:
    """Each held request's block table as a row of one int32 array, kept between steps.

    A request's table only grows while the engine holds it (blocks are appended), so a
    step writes just the blocks added since the request's last step, and a step's
    tables are one gather of their rows. A request re-sent under its id (a new state)
    gets its row rewritten; `release` frees and zeroes the row (rows are 0 past their
    table, as attention's padding must be)."""

    def __init__(self, cols: int) -> None:
        self.rows = np.zeros((0, cols), dtype=np.int32)
        self.held: dict[str, tuple[int, RequestState, int]] = {}  # id -> (row, state, filled)
        self.free: list[int] = []

    def row(self, request_id: str, state: RequestState) -> int:
        """The request's row, up to date with its blocks."""
        blocks = state.block_ids
        n = len(blocks)
        if n > self.rows.shape[1]:  # longer than max_model_len's table: grow, as before
            self.widen(n)
        entry = self.held.get(request_id)
        if entry is not None and entry[1] is state:
            row, _, filled = entry
            if n != filled:
                self.rows[row, filled:n] = blocks[filled:]
                self.held[request_id] = (row, state, n)
            return row
        if entry is None:
            row = self._take()
        else:
            row = entry[0]
            self.rows[row].fill(0)
        self.rows[row, :n] = blocks
        self.held[request_id] = (row, state, n)
        return row

    def release(self, request_id: str) -> None:
        if (entry := self.held.pop(request_id, None)) is not None:
            self.rows[entry[0]].fill(0)
            self.free.append(entry[0])

    def clear(self) -> None:
        self.held.clear()
        self.rows.fill(0)
        self.free = list(range(len(self.rows) - 1, -1, -1))

    def widen(self, cols: int) -> None:
        if cols > self.rows.shape[1]:
            self.rows = np.pad(self.rows, ((0, 0), (0, cols - self.rows.shape[1])))

    def _take(self) -> int:
        if not self.free:
            have = len(self.rows)
            more = max(64, have)
            self.rows = np.pad(self.rows, ((0, more), (0, 0)))
            self.free = list(range(have + more - 1, have - 1, -1))
        return self.free.pop()


class ModelRunner:
    def __init__(
        self,
        model: Model,
        kv_cache: KVCache,
        graphs: DecodeGraphs | None,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        staged: bool | None = None,
        pieces: PiecewiseGraphs | None = None,
    ) -> None:
        """`staged`: copy each step's inputs into device buffers (default: off the CPU;
        tests turn it on there to check the layout). `pieces`: the piecewise graphs, for
        steps `graphs` does not take."""
        self.model, self.kv_cache, self.graphs = model, kv_cache, graphs
        self.pieces = pieces
        # forwards run so far by path: decode graph, piecewise graphs, eager
        self.forwards = {"decode_graph": 0, "piecewise": 0, "eager": 0}
        self.block_size = kv_cache.block_size
        self.device = device
        self._pin = self.device.type == "cuda"
        self._staged = device.type != "cpu" if staged is None else staged
        self._copied: torch.cuda.Event | None = None  # the last step's copies, on CUDA
        # Deferred samples the engine has not taken yet, oldest first: (sampled ids on the
        # device, the requests of their rows). Their requests' last tokens are PENDING.
        self._unsettled: list[tuple[torch.Tensor, list[str]]] = []
        cols = -(-max_model_len // self.block_size)
        self.tables = BlockTables(cols)
        self._alloc_tokens(max_num_tokens)
        self._alloc_tables(max_num_seqs, cols)

    def _buffer(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(host buffer, its device mirror: the host buffer itself when not staged)."""
        host = torch.zeros(n, dtype=dtype, pin_memory=self._pin)
        return host, torch.zeros(n, dtype=dtype, device=self.device) if self._staged else host

    def _alloc_tokens(self, n: int) -> None:
        self._wait_for_copies()  # the old buffers may still be read by a copy
        self._tokens, self._tokens_dev = self._buffer(6 * n, torch.long)
        self._tokens_np = self._tokens.numpy()
        self._max_tokens = n

    def _alloc_tables(self, rows: int, cols: int) -> None:
        self._wait_for_copies()
        self._ints, self._ints_dev = self._buffer(rows * cols + 2 * rows + 1, torch.int32)
        self._ints_np = self._ints.numpy()
        self._table_shape = (rows, cols)
        self.tables.widen(cols)

    def release(self, request_id: str) -> None:
        """The engine no longer holds the request: its block table's row is free."""
        self.tables.release(request_id)

    def release_all(self) -> None:
        self.tables.clear()
        self._unsettled.clear()

    def taken(self, samples: DeviceSamples) -> None:
        """The engine wrote these samples over their requests' PENDING tokens."""
        self._unsettled = [u for u in self._unsettled if u[0] is not samples.token_ids]

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    @property
    def capacity(self) -> tuple[int, int, int]:
        """(tokens, sequences, blocks per sequence) the buffers hold without growing."""
        return self._max_tokens, *self._table_shape

    def prepare(self, rows: list[Row]) -> StepInputs:
        """The step's tensors; `rows` must be decodes first (one token each), then rows with
        a proposal, then prefill chunks.

        A row with a proposal (its last known token and k proposed ones) goes to attention
        as k + 1 one-token queries of the same request, the j-th seeing j more positions:
        every backend writes a step's K/V before it attends, so that is causal attention
        over the k + 1 tokens, and the step stays a decode step (the CPU's fused decode,
        CUDA graphs)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        table_rows: list[int] = []  # per attention sequence, its row in self.tables
        pending: list[tuple[int, str]] = []  # (position in ids, request) of PENDING tokens
        table_row = self.tables.row
        width = 0
        for r in rows:
            st, p = r.state, r.start
            blocks = st.block_ids
            width = max(width, len(blocks))
            if r.count == 1 and not r.draft:  # a decode (most rows of most steps)
                t = st.token_ids[p]
                if t < 0:
                    pending.append((len(ids), r.request_id))
                ids.append(t)
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
                if p + 1 == len(st.token_ids):
                    sample_idx.append(len(ids) - 1)
                seq_lens.append(p + 1)
                query_lens.append(1)
                table_rows.append(table_row(r.request_id, st))
                continue
            end = p + r.count
            ids.extend(st.token_ids[p:end])
            if ids[-1] < 0:
                pending.append((len(ids) - 1, r.request_id))
            if PENDING in st.token_ids[p : end - 1]:  # only a request's last token can be
                raise RuntimeError(f"request {r.request_id!r}: a pending token inside a chunk")
            pos = range(p, end)
            positions.extend(pos)
            slots.extend(blocks[q // bs] * bs + q % bs for q in pos)
            if r.draft or r.as_decodes:
                if r.draft:  # samples after each of its k + 1 tokens
                    sample_idx.extend(range(len(ids) - r.count, len(ids)))
                elif r.samples:
                    sample_idx.append(len(ids) - 1)
                seq_lens.extend(range(p + 1, end + 1))
                query_lens.extend([1] * r.count)
                table_rows.extend([table_row(r.request_id, st)] * r.count)
                continue
            if r.samples:
                sample_idx.append(len(ids) - 1)
            seq_lens.append(end)
            query_lens.append(r.count)
            table_rows.append(table_row(r.request_id, st))
        n = len(ids)
        num_seqs = len(table_rows)
        num_decodes = sum(1 for q in query_lens if q == 1)
        held, seqs, cols = self.capacity
        if n > held:
            self._alloc_tokens(max(n, 2 * held))
        if num_seqs > seqs or width > cols:
            self._alloc_tables(max(num_seqs, seqs), max(width, cols))
        sources = self._pending_sources(pending)
        self._wait_for_copies()
        m = len(sample_idx)  # <= n: one per sampled token row
        f = len(pending)  # <= n
        toks = self._tokens_np
        toks[:n], toks[n : 2 * n], toks[2 * n : 3 * n] = ids, positions, slots
        toks[3 * n : 3 * n + m] = sample_idx
        if f:
            at = 3 * n + m
            toks[at : at + f] = [i for _, i, _ in sources]
            toks[at + f : at + 2 * f] = [j for _, _, j in sources]
        ints = self._ints_np
        o = num_seqs * width
        np.take(self.tables.rows[:, :width], table_rows, axis=0, out=ints[:o].reshape(-1, width))
        ints[o : o + num_seqs] = seq_lens
        q_at = o + num_seqs  # the prefill chunks' query starts, from 0
        num_prefills = num_seqs - num_decodes
        ints[q_at] = 0
        if num_prefills:  # (a decode step has none: no list to convert)
            np.cumsum(query_lens[num_decodes:], out=ints[q_at + 1 : q_at + 1 + num_prefills])
        tok, it = self._tokens_dev, self._ints_dev
        if self._staged:
            used = q_at + 1 + num_prefills
            k = 3 * n + m + 2 * f
            tok[:k].copy_(self._tokens[:k], non_blocking=True)
            it[:used].copy_(self._ints[:used], non_blocking=True)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))
        meta = AttentionMetadata(
            slot_mapping=tok[2 * n : 3 * n],
            block_tables=it[:o].view(num_seqs, width),
            seq_lens=seq_lens,
            query_lens=query_lens,
            num_decodes=num_decodes,
            block_size=bs,
        )
        if self._staged:  # on the device already: the backend makes no copies of its own
            meta.seq_lens_tensor = it[o:q_at]
            if num_prefills:
                meta.query_start_loc = it[q_at : q_at + 1 + num_prefills]
        if f:  # PENDING tokens: gathered from the earlier step's samples, on the device
            at, i = 3 * n + m, 0
            while i < f:
                src = sources[i][0]
                j = i + 1
                while j < f and sources[j][0] is src:
                    j += 1
                rows_in_src = src.index_select(0, tok[at + f + i : at + f + j])
                tok[:n].index_copy_(0, tok[at + i : at + j], rows_in_src)
                i = j
        return StepInputs(
            tok[:n], tok[n : 2 * n], meta, [r for r in rows if r.samples], tok[3 * n : 3 * n + m]
        )

    def _pending_sources(
        self, pending: list[tuple[int, str]]
    ) -> list[tuple[torch.Tensor, int, int]]:
        """(samples tensor, position in ids, row in the tensor) per PENDING token, grouped
        by tensor (a request's latest deferred sample is its PENDING token)."""
        if not pending:
            return []
        where = {rid: (ids, j) for ids, rids in self._unsettled for j, rid in enumerate(rids)}
        out = []
        for at, rid in pending:
            if (entry := where.get(rid)) is None:
                raise RuntimeError(f"request {rid!r}: its last token was never sampled")
            out.append((entry[0], at, entry[1]))
        if len({id(t) for t, _, _ in out}) > 1:
            out.sort(key=lambda e: id(e[0]))
        return out

    def run(self, rows: list[Row], capture_logits: bool = False, defer: bool = False) -> StepOutput:
        """Prepare, forward (a decode CUDA graph where one fits, else piecewise graphs
        where a size fits, else eagerly), sample the rows that end.
        `defer`: unless a row verifies a proposal, leave the samples on the device
        (StepOutput.deferred; their requests' last tokens are PENDING to later steps)."""
        tp = time.perf_counter_ns()
        x = self.prepare(rows)
        start = self._timing_event() if defer else None
        t0 = time.perf_counter_ns()  # forward_ns: from the inputs' copy to the device
        hidden = self._forward(x)
        every = None
        if capture_logits:
            every = list(self.model.logits(hidden).split([r.count for r in rows]))
        prompt_lps = self._prompt_logprobs(rows, hidden)
        mid = self._timing_event() if start is not None else None
        t1 = time.perf_counter_ns()
        sampled = deferred = end = None
        if x.sample_rows:
            samples = self._sample(x.sample_rows, self.model.logits(hidden[x.sample_index]))
            keep = defer and not any(r.draft for r in x.sample_rows)
            if keep and mid is not None:  # before the copy, so that the copy's event (what
                end = self._timing_event()  # `finish` waits for) implies it has completed
            samples.copy_to_host()
            if keep:
                deferred = samples
                self._unsettled.append((samples.token_ids, [r.request_id for r in x.sample_rows]))
            else:
                sampled = samples.to_host()
        t2 = time.perf_counter_ns()
        n = int(x.input_ids.numel())
        out = StepOutput(
            sampled, n, t1 - t0, t2 - t1, every, prompt_lps, t0 - tp, x.sample_rows, deferred
        )
        if start is not None and mid is not None and end is not None:
            out.device_times = (start, mid, end)
        return out

    def _forward(self, x: StepInputs) -> torch.Tensor:
        if self.graphs is not None and (b := self.graphs.padded_size(x.meta)) is not None:
            self.forwards["decode_graph"] += 1
            return self.graphs.run(b, x.input_ids, x.positions, x.meta)
        n = int(x.input_ids.shape[0])
        if self.pieces is not None and (t := self.pieces.padded_size(n)) is not None:
            self.forwards["piecewise"] += 1
            return self.pieces.run(t, x.input_ids, x.positions, x.meta)
        self.forwards["eager"] += 1
        return self.model.forward(x.input_ids, x.positions, x.meta, self.kv_cache.layers)

    def _timing_event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the device's stream now (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _prompt_logprobs(self, rows: list[Row], hidden: torch.Tensor) -> PromptLogprobs | None:
        """For rows that asked: each computed prompt position's logits score the prompt
        token after it (logprob, rank, top ones), as vLLM's prompt_logprobs; computed on
        the device, read on the host when the step finishes."""
        asked: list[tuple[str, int, list[int], int]] = []
        tensors: list[torch.Tensor | None] = []
        offset = 0
        for r in rows:
            st, k = r.state, r.state.sampling.prompt_logprobs
            last = min(r.start + r.count, st.num_prompt_tokens - 1)
            if k is not None and last > r.start:
                n = last - r.start
                logp = torch.log_softmax(self.model.logits(hidden[offset : offset + n]).float(), -1)
                targets = st.token_ids[r.start + 1 : last + 1]
                lp = logp.gather(1, to_device(targets, torch.long, logp.device)[:, None])
                ranks = (logp > lp).sum(dim=1) + 1
                top = logp.topk(k, dim=-1) if k else None
                asked.append((r.request_id, r.start + 1, targets, k))
                tensors += [lp[:, 0], ranks, *(top if top is not None else (None, None))]
            offset += r.count
        return PromptLogprobs(asked, HostCopy.of(tensors)) if asked else None

    @staticmethod
    def _sample(rows: list[Row], logits: torch.Tensor) -> DeviceSamples:
        """Sample each row's next token, with its penalties and min_tokens ban. A row with
        a proposal of k tokens samples k + 1 times, the j-th as if its known tokens ended
        with the first j proposed ones (penalties, min_tokens and seeds see that length)."""
        if all(r.mask is None and not r.draft and r.state.sampling.plain_greedy for r in rows):
            return DeviceSamples(logits.argmax(dim=-1))
        states: list[RequestState] = []
        lengths: list[int] = []  # tokens known at each sampled position
        row_masks: list[pb.TokenMask | None] = []
        for r in rows:
            n = len(r.state.token_ids)
            if r.draft:  # (a row with a proposal has no mask)
                base = n - len(r.draft)
                states += [r.state] * (len(r.draft) + 1)
                lengths += range(base, n + 1)
                row_masks += [None] * (len(r.draft) + 1)
            else:
                states.append(r.state)
                lengths.append(n)
                row_masks.append(r.mask)
        specs = [s.sampling for s in states]
        penalised = [s.penalised for s in specs]
        masks = row_masks if any(m is not None for m in row_masks) else None
        return sample_on_device(
            logits,
            specs,
            [
                s.token_ids[: s.num_prompt_tokens] if p else []
                for s, p in zip(states, penalised, strict=True)
            ],
            [
                s.token_ids[s.num_prompt_tokens : n] if p else []
                for s, p, n in zip(states, penalised, lengths, strict=True)
            ],
            lengths,
            [
                s.sampling.banned_until_min
                if n - s.num_prompt_tokens < s.sampling.min_tokens
                else ()
                for s, n in zip(states, lengths, strict=True)
            ],
            masks,
        )
