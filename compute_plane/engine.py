"""The compute engine: per-request state, step validation, batch building, forward, sampling.

The control plane decides what runs and which blocks hold it; this engine only
checks that a step is well formed, computes it and samples. A malformed step is
rejected whole (StepRejected) before any state changes.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from compute_plane import metrics
from compute_plane.attention import AttentionMetadata
from compute_plane.attention.factory import model_kernels, resolve_attention_backend
from compute_plane.config import ComputeConfig
from compute_plane.cuda_graphs import DecodeGraphs
from compute_plane.device import resolve_device, resolve_dtype
from compute_plane.gpu_memory import num_blocks_from_free_memory
from compute_plane.kv_cache import KVCache, num_blocks_for_budget
from compute_plane.loader import LoadedModel
from compute_plane.model import Model
from compute_plane.sampler import sample
from hetero_common.logs import split_choice_id
from hetero_common.sampling_params import SamplingSpec
from hetero_proto import compute_pb2 as pb

log = logging.getLogger(__name__)


def _log_request(message: str, choice_id: str) -> None:
    """A per-request line: `request_id` is the client's id (see hetero_common.logs)."""
    if log.isEnabledFor(logging.INFO):
        request_id, choice = split_choice_id(choice_id)
        log.info(message, extra={"request_id": request_id, "choice": choice})


class StepRejected(Exception):
    """A step the engine will not run; `code` is a gRPC status code name."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingSpec


@dataclass
class _Row:
    """One request's share of a step."""

    request_id: str
    state: RequestState
    start: int  # first position computed this step
    count: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.state.token_ids)


class Engine:
    def __init__(self, config: ComputeConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model_config = loaded.config
        self.model_name = loaded.config.name or loaded.path.name
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        cfg = loaded.config
        self.block_size = config.block_size
        backend = resolve_attention_backend(config.attention_backend, self.device, self.dtype)
        kernels = model_kernels(backend, cfg, self.device)
        max_len = min(
            cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings
        )
        if self.device.type == "cuda":  # the pool gets what is left once a step has run
            free_before, _ = torch.cuda.mem_get_info(self.device)
            self.model = Model(cfg, loaded.weights, self.device, self.dtype, max_len + 1, kernels)
            num_blocks = num_blocks_from_free_memory(self.model, config, max_len, free_before)
        else:
            num_blocks = num_blocks_for_budget(
                cfg, self.block_size, self.dtype, config.kv_cache_bytes
            )
            max_len = min(max_len, (num_blocks - 1) * self.block_size)
            self.model = Model(cfg, loaded.weights, self.device, self.dtype, max_len + 1, kernels)
        self.max_model_len = min(max_len, (num_blocks - 1) * self.block_size)
        self.kv_cache = KVCache(cfg, num_blocks, self.block_size, self.dtype, self.device)
        self.num_blocks = num_blocks
        self.graphs = (  # decode graphs need the Triton kernels: they make no host round trips
            DecodeGraphs(
                self.model,
                self.kv_cache.layers,
                self.block_size,
                self.max_model_len,
                config.max_num_seqs,
            )
            if self.device.type == "cuda" and config.cuda_graphs and backend == "triton"
            else None
        )
        self.requests: dict[str, RequestState] = {}
        self.counters = pb.StatsResponse()
        self._metric_labels = {"model_name": self.model_name}
        self._init_metrics(loaded)
        # Tests of numeric parity turn this on to see the logits of every computed
        # token (the serving path only computes logits of the tokens it samples).
        self.capture_logits = False
        self.captured_logits: dict[str, list[torch.Tensor]] = {}

    def _init_metrics(self, loaded: LoadedModel) -> None:
        m = self._metric_labels
        metrics.kv_blocks_total.labels(**m).set(self.num_blocks)
        # A weak reference: the metric registry is global and must not keep the engine
        # (its weights and KV cache) alive after its owner drops it.
        ref = weakref.ref(self)
        metrics.kv_blocks_used.labels(**m).set_function(
            lambda: e._blocks_in_use() if (e := ref()) is not None else 0
        )
        weights = sum(t.nbytes for t in loaded.weights.values())
        held = (
            torch.cuda.memory_allocated()
            if self.device.type == "cuda"
            else weights + self.kv_cache.nbytes
        )
        metrics.device_memory_used.labels(**m).set(held)

    def _blocks_in_use(self) -> int:
        tables = [
            st.block_ids for st in list(self.requests.values())
        ]  # copy: read from the scrape thread
        return len({b for t in tables for b in t})

    # ------------------------------------------------------------------ API
    def describe(self) -> pb.DescribeResponse:
        cfg = self.model_config
        return pb.DescribeResponse(
            model_name=self.model_name,
            architecture=cfg.architecture,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            block_size=self.block_size,
            num_kv_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(cfg.eos_token_ids),
            num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            kv_cache_bytes=self.kv_cache.nbytes,
            bos_token_id=-1 if cfg.bos_token_id is None else cfg.bos_token_id,
            attention_backend=self.model.attention.name,
        )

    def reset(self) -> None:
        self.requests.clear()
        self.counters = pb.StatsResponse()

    def stats(self) -> pb.StatsResponse:
        s = pb.StatsResponse()
        s.CopyFrom(self.counters)
        s.num_active_requests = len(self.requests)
        return s

    def warmup(self) -> None:
        """One tiny forward so the first real step does not pay for lazy initialisation."""
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            seq_lens=[1],
            query_lens=[1],
            num_decodes=1,
            block_size=self.block_size,
        )
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        hidden = self.model.forward(zero, zero, meta, self.kv_cache.layers)
        self.model.logits(hidden)
        if self.graphs is not None:
            self.graphs.capture()

    def step(self, req: pb.StepRequest) -> pb.StepResult:
        """Run one step. Raises StepRejected (no state changed) for a malformed step."""
        rows = self._validate(req)
        for rid in req.finished_ids:
            if self.requests.pop(rid, None) is not None:
                _log_request("request released", rid)
        for rid, state, _ in rows:
            self.requests[rid] = state  # new requests; continuing ones are already there
        for n in req.new_requests:
            _log_request(f"request added: {len(n.token_ids)} tokens", n.request_id)
        for c in req.continuing:
            self.requests[c.request_id].block_ids.extend(c.new_block_ids)
        result = pb.StepResult(step_id=req.step_id)
        if rows:
            self._run([_Row(rid, st, st.num_computed_tokens, n) for rid, st, n in rows], result)
        self.counters.num_steps += 1
        self.counters.num_requests_added += len(req.new_requests)
        return result

    # ----------------------------------------------------------- validation
    def _validate(self, req: pb.StepRequest) -> list[tuple[str, RequestState, int]]:
        """Check the whole step; return (id, state, num tokens) per scheduled request."""
        nb = self.num_blocks
        finished = set(req.finished_ids)
        seen: set[str] = set()
        rows: list[tuple[str, RequestState, int]] = []

        def check_blocks(rid: str, blocks: list[int]) -> None:
            if blocks and (min(blocks) < 1 or max(blocks) >= nb):
                bad = next(b for b in blocks if not 1 <= b < nb)
                raise StepRejected(
                    f"request {rid!r}: block id {bad} out of range (valid: 1..{nb - 1}; 0 is the null block)"
                )

        def check_once(rid: str) -> None:
            if rid in seen:
                raise StepRejected(f"request {rid!r} appears twice in step {req.step_id}")
            seen.add(rid)

        for n in req.new_requests:
            rid = n.request_id
            check_once(rid)
            if rid in self.requests and rid not in finished:
                raise StepRejected(f"request {rid!r} is already active; send it as continuing")
            tokens = list(n.token_ids)
            if not tokens:
                raise StepRejected(f"request {rid!r}: no token ids")
            if min(tokens) < 0 or max(tokens) >= self.model_config.vocab_size:
                raise StepRejected(
                    f"request {rid!r}: token id out of range 0..{self.model_config.vocab_size - 1}"
                )
            if len(tokens) > self.max_model_len:
                raise StepRejected(
                    f"request {rid!r}: {len(tokens)} tokens exceed max_model_len {self.max_model_len}"
                )
            if not 0 <= n.num_prompt_tokens <= len(tokens):
                raise StepRejected(
                    f"request {rid!r}: num_prompt_tokens {n.num_prompt_tokens} not in 0..{len(tokens)}"
                )
            if n.num_computed_tokens < 0:
                raise StepRejected(f"request {rid!r}: negative num_computed_tokens")
            blocks = list(n.block_ids)
            check_blocks(rid, blocks)
            spec = SamplingSpec.from_proto(n.sampling)
            problem = spec.validate()
            if problem:
                raise StepRejected(f"request {rid!r}: {problem}")
            state = RequestState(tokens, n.num_prompt_tokens, n.num_computed_tokens, blocks, spec)
            self._check_count(rid, state, len(blocks), n.num_scheduled_tokens)
            rows.append((rid, state, n.num_scheduled_tokens))

        def active(rid: str) -> RequestState:
            check_once(rid)
            if rid not in self.requests or rid in finished:
                raise StepRejected(f"unknown request id {rid!r} (not active on this compute plane)")
            return self.requests[rid]

        for c in req.continuing:
            rid = c.request_id
            state = active(rid)
            check_blocks(rid, list(c.new_block_ids))
            self._check_count(
                rid, state, len(state.block_ids) + len(c.new_block_ids), c.num_scheduled_tokens
            )
            rows.append((rid, state, c.num_scheduled_tokens))
        for rid in req.decode_ids:
            state = active(rid)
            self._check_count(rid, state, len(state.block_ids), 1)
            rows.append((rid, state, 1))
        total = sum(n for _, _, n in rows)
        if self.device.type == "cuda" and total > self.config.max_num_batched_tokens:
            raise StepRejected(
                f"step of {total} tokens exceeds max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens} (the activation peak the KV pool was sized for)",
                "RESOURCE_EXHAUSTED",
            )
        return rows

    def _check_count(self, rid: str, state: RequestState, num_blocks: int, n: int) -> None:
        end = state.num_computed_tokens + n
        if n < 1:
            raise StepRejected(f"request {rid!r}: num_scheduled_tokens must be >= 1, got {n}")
        if end > len(state.token_ids):
            raise StepRejected(
                f"request {rid!r}: {n} tokens scheduled from position {state.num_computed_tokens} "
                f"but only {len(state.token_ids)} tokens are known"
            )
        if end > num_blocks * self.block_size:
            raise StepRejected(
                f"request {rid!r}: {end} tokens do not fit in {num_blocks} blocks of {self.block_size}"
            )

    # ------------------------------------------------------------- compute
    def _run(self, rows: list[_Row], result: pb.StepResult) -> None:
        rows.sort(key=lambda r: r.count != 1)  # decodes first (stable)
        dev, bs = self.device, self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        for r in rows:
            st = r.state
            end = r.start + r.count
            ids.extend(st.token_ids[r.start : end])
            pos = range(r.start, end)
            positions.extend(pos)
            table = st.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if r.samples:
                sample_idx.append(len(ids) - 1)
        max_blocks = max(len(r.state.block_ids) for r in rows)
        tables = torch.zeros((len(rows), max_blocks), dtype=torch.int32)
        for i, r in enumerate(rows):
            tables[i, : len(r.state.block_ids)] = torch.tensor(r.state.block_ids, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=[r.start + r.count for r in rows],
            query_lens=[r.count for r in rows],
            num_decodes=sum(1 for r in rows if r.count == 1),
            block_size=bs,
        )
        t0 = time.perf_counter_ns()
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        graph = self.graphs.padded_size(meta) if self.graphs is not None else None
        if graph is not None:
            assert self.graphs is not None
            hidden = self.graphs.run(graph, input_ids, pos_t, meta)
        else:
            hidden = self.model.forward(input_ids, pos_t, meta, self.kv_cache.layers)
        if self.capture_logits:
            every = self.model.logits(hidden).split([r.count for r in rows])
            for r, lg in zip(rows, every, strict=True):
                self.captured_logits.setdefault(r.request_id, []).append(lg)
        sampling_rows = [r for r in rows if r.samples]
        t1 = time.perf_counter_ns()
        if sampling_rows:
            logits = self.model.logits(hidden[torch.tensor(sample_idx, device=dev)])
            self._sample(sampling_rows, logits, result)
        t2 = time.perf_counter_ns()

        c = self.counters
        for r in rows:
            np_ = r.state.num_prompt_tokens
            prompt_part = max(0, min(np_, r.start + r.count) - r.start)
            c.num_prompt_tokens_computed += prompt_part
            c.num_output_tokens_computed += r.count - prompt_part
            r.state.num_computed_tokens += r.count
        decodes = meta.num_decodes
        kind = "decode" if decodes == len(rows) else "prefill" if decodes == 0 else "mixed"
        m = self._metric_labels
        metrics.step_duration.labels(kind=kind, **m).observe((t2 - t0) / 1e9)
        metrics.tokens_per_step.labels(**m).observe(len(ids))
        metrics.seqs_per_step.labels(**m).observe(len(rows))
        result.num_tokens = len(ids)
        result.num_seqs = len(rows)
        result.forward_ns = t1 - t0
        result.sample_ns = t2 - t1

    def _sample(self, rows: list[_Row], logits: torch.Tensor, result: pb.StepResult) -> None:
        specs = [r.state.sampling for r in rows]
        penalised = [
            s.repetition_penalty != 1.0 or s.frequency_penalty or s.presence_penalty for s in specs
        ]
        out = sample(
            logits,
            specs,
            [
                r.state.token_ids[: r.state.num_prompt_tokens] if p else []
                for r, p in zip(rows, penalised, strict=True)
            ],
            [
                r.state.token_ids[r.state.num_prompt_tokens :] if p else []
                for r, p in zip(rows, penalised, strict=True)
            ],
            [len(r.state.token_ids) for r in rows],
            [
                r.state.sampling.banned_until_min
                if len(r.state.token_ids) - r.state.num_prompt_tokens < r.state.sampling.min_tokens
                else ()
                for r in rows
            ],
        )
        sampled_ids: list[str] = []
        for i, r in enumerate(rows):
            tok = out.token_ids[i]
            r.state.token_ids.append(tok)
            sampled_ids.append(r.request_id)
            spec = r.state.sampling
            if not (spec.logprobs or spec.top_logprobs):
                continue
            tr = result.results.add(request_id=r.request_id, token_id=tok)
            if spec.logprobs and out.logprobs is not None:
                tr.logprob = out.logprobs[i]
            if spec.top_logprobs and out.top_ids is not None and out.top_logprobs is not None:
                for tid, lp in zip(
                    out.top_ids[i][: spec.top_logprobs], out.top_logprobs[i], strict=False
                ):
                    tr.top_logprobs.add(token_id=tid, logprob=lp)
        result.sampled_ids.extend(sampled_ids)
        result.sampled_token_ids.extend(out.token_ids)
        self.counters.num_sampled_tokens += len(rows)
