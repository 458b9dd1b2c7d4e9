"""The compute engine: per-request state, step validation, batch building, forward, sampling.

The control plane decides what runs and which blocks hold it; this engine only
checks that a step is well formed, computes it and samples. A malformed step is
rejected whole (StepRejected) before any state changes.

A step is launched (`launch`: validate, update the requests, queue the forward and the
sampling) and finished (`finish`: its samples reach the host, the result is made);
`step` does both. While a step is launched and not finished, its sampling requests'
last tokens are PENDING (model_runner): the next step may be launched already, taking
them on the device, so on a GPU the host prepares step k + 1 while step k computes.
(A step verifying proposals samples on the host at once: its acceptance needs them.)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compute_plane import metrics, quant
from compute_plane.attention import AttentionMetadata
from compute_plane.attention.factory import model_kernels, resolve_attention_backend
from compute_plane.config import ComputeConfig
from compute_plane.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from compute_plane.device import (
    resolve_device,
    resolve_dtype,
    resolve_quantization,
    use_device,
)
from compute_plane.gpu_memory import num_blocks_from_free_memory
from compute_plane.host_memory import check_kv_budget, weights_estimate
from compute_plane.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget
from compute_plane.loader import LoadedModel, load_model
from compute_plane.loader.fingerprint import weights_fingerprint
from compute_plane.model import Model, ModelKernels
from compute_plane.model_runner import PENDING, ModelRunner, PromptLogprobs, StepOutput
from compute_plane.requests import (
    Failure,
    RequestState,
    Row,
    StepLimits,
    StepValidator,
)
from compute_plane.sampler import DeviceSamples, SampleOutput
from compute_plane.speculative import Drafter, accepted_length
from hetero_common.logs import split_choice_id
from hetero_common.model_path import model_display_name, resolve_model_path
from hetero_common.tracing import RequestSpan, start_span
from hetero_proto import compute_pb2 as pb

log = logging.getLogger(__name__)


def _log_request(message: str, choice_id: str) -> None:
    """A per-request line: `request_id` is the client's id (see hetero_common.logs)."""
    if log.isEnabledFor(logging.INFO):
        request_id, choice = split_choice_id(choice_id)
        log.info(message, extra={"request_id": request_id, "choice": choice})


def _start_span(n: pb.NewRequest) -> RequestSpan:
    """A request's span in this plane (added until released), child of the control plane's."""
    request_id, choice = split_choice_id(n.request_id)
    return start_span(
        "compute.request",
        n.traceparent,
        {
            "hetero.request_id": request_id,
            "hetero.choice": -1 if choice is None else choice,
            "hetero.tokens": len(n.token_ids),
            "hetero.computed_tokens": n.num_computed_tokens,
        },
    )


def _end_span(state: RequestState) -> None:
    state.span.set({"hetero.tokens": len(state.token_ids)})
    state.span.end()


def load_for(config: ComputeConfig, path: Path, progress: bool = False) -> LoadedModel:
    """Load the model as `config` will run it: quantized GGUF matrices stay quantized
    (never materialised in float) where the engine keeps them so."""
    device = resolve_device(config.device)
    mode = resolve_quantization(config.quantization, device, resolve_dtype(config.dtype, device))
    return load_model(
        path,
        progress=progress,
        quantized=mode in ("gguf", "int8"),
        keep_fp8=mode in ("checkpoint", "fp8", "int8_scaled"),
    )


def check_memory_before_loading(config: ComputeConfig, path: Path) -> None:
    """On the CPU, before any weight is read: ValueError naming both when the weights
    (their files' size, an estimate; the draft model's too) and --kv-cache-bytes are more
    than the memory available. Weights too big for the machine otherwise met the OOM
    killer part way through loading; the KV cache alone is checked again once they are in."""
    if resolve_device(config.device).type != "cpu":
        return
    check_kv_budget(config.kv_cache_bytes, 1, weights_estimate(path, config.draft_model))


def _return_freed_memory() -> None:
    """Give the allocator's free pages back to the OS after loading (glibc keeps them:
    the loader's temporaries and the weights fused into new tensors would otherwise stay
    in the process's resident memory, ~50 MB for the bundled model)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass(eq=False)
class Launched:
    """A step launched on the device; `Engine.finish` makes its result."""

    result: pb.StepResult
    # With deferred samples: the rows that sample, in order (each one's PENDING token
    # stands at r.start + r.count in its request's tokens).
    rows: list[Row] = field(default_factory=list)
    samples: DeviceSamples | None = None
    out: SampleOutput | None = None  # the samples, once on the host
    prompt_logprobs: PromptLogprobs | None = None  # of the rows that asked, on their way
    # CUDA: the step's device-time events, its kind, and the previous timed step's end
    # event (None: none to measure the device's idle time from), for its timings once
    # finished
    timing: (
        tuple[
            tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event],
            str,
            torch.cuda.Event | None,
        ]
        | None
    ) = None

    # Both may run on the server's waiter thread while `Engine.finish` clears the fields on
    # the step thread: each reads a field once.

    def ready(self) -> bool:
        """Its samples and prompt logprobs are on the host (finishing it will not wait)."""
        samples, lps = self.samples, self.prompt_logprobs
        return (samples is None or samples.ready()) and (lps is None or lps.copy.ready())

    def wait(self) -> None:
        samples, lps = self.samples, self.prompt_logprobs
        if samples is not None:
            samples.wait()
        if lps is not None:
            lps.copy.wait()


class Engine:
    def __init__(self, config: ComputeConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model_config = loaded.config
        self.model_name = loaded.config.name or loaded.path.name
        self.device = resolve_device(config.device)
        use_device(self.device)  # this thread's; a server's other threads: compute_plane.server
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.quantization = resolve_quantization(config.quantization, self.device, self.dtype)
        cfg = loaded.config
        self.block_size = config.block_size
        backend = resolve_attention_backend(config.attention_backend, self.device, self.dtype)
        kernels = model_kernels(backend, cfg, self.device)
        # the decode step's Triton kernels as programmatic dependent launches (--pdl)
        self.dependent_launch = self._set_dependent_launch(backend)
        draft = self._load_draft(backend) if config.draft_model else None
        # Before the engine quantizes or fuses them: the weights as the file holds them.
        self.weights_fingerprint = weights_fingerprint(loaded)
        self.model, num_blocks = self._model_and_pool(loaded, kernels, draft)
        self.max_model_len = min(self.model_max_len, (num_blocks - 1) * self.block_size)
        self.kv_cache = KVCache(cfg, num_blocks, self.block_size, self.dtype, self.device)
        self.num_blocks = num_blocks
        # µs per layer of the fused small-batch linears vs the separate kernels, by rows
        # (timed at warm-up on CUDA: --fused-linear auto)
        self.fused_linear_timings: list[dict[str, float]] = []
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
        tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
        # the other steps' graphs, cut at attention (never larger than a step may be)
        self.pieces = (
            PiecewiseGraphs(
                self.model,
                self.kv_cache.layers,
                min(config.piecewise_graphs, tokens),
                self.block_size,
            )
            if self.graphs is not None and config.piecewise_graphs > 0
            else None
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.graphs, tokens, seqs, self.max_model_len, self.device,
            pieces=self.pieces,
        )  # fmt: skip
        self.drafter = None
        if draft is not None:
            model, name = draft
            kv = KVCache(model.cfg, num_blocks, self.block_size, self.dtype, self.device)
            runner = ModelRunner(model, kv, None, tokens, seqs, self.max_model_len, self.device)
            self.drafter = Drafter(model, kv, runner, name)
        cuda = self.device.type == "cuda"
        self.validator = StepValidator(
            StepLimits(
                num_blocks,
                self.block_size,
                cfg.vocab_size,
                self.max_model_len,
                tokens if cuda else None,
                config.max_speculative_tokens,
                self.drafter is not None,
            )
        )
        self.requests: dict[str, RequestState] = {}
        self.failed_alone: dict[str, Failure] = {}  # failed, not yet in a step's finished_ids
        self.counters = pb.StatsResponse()
        # The served model's id, as the control plane's ModelInfo and metrics name it.
        name = config.served_model_name or model_display_name(loaded.path)
        self.metric_labels = {"model_name": name}
        self._init_metrics(loaded)
        # Tests of numeric parity turn this on to see the logits of every computed
        # token (the serving path only computes logits of the tokens it samples).
        self.capture_logits = False
        self.captured_logits: dict[str, list[torch.Tensor]] = {}
        self._unsettled: list[Launched] = []  # launched, samples not yet taken, oldest first
        # CUDA: the end event of the last step launched, when it was timed on the device
        self._last_end: torch.cuda.Event | None = None
        # The server launches step k + 1 before finishing step k (`launch` / `finish`):
        # worth it where the forward runs behind the host (CUDA); on the CPU the forward
        # runs within `launch`, so finishing first returns step k's result sooner.
        mode = config.overlap_steps
        self.overlap = mode == "on" or (mode == "auto" and self.device.type == "cuda")

    def _load_draft(self, backend: str) -> tuple[Model, str]:
        """The draft model for speculative decoding (its weights on the device before the
        KV pool is sized, so the pool leaves room for them)."""
        cfg, config = self.model_config, self.config
        path = resolve_model_path(config.draft_model or "")
        loaded = load_for(config, path)
        dcfg = loaded.config
        if dcfg.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"draft model {path.name}: vocabulary of {dcfg.vocab_size} tokens, the target's "
                f"has {cfg.vocab_size}; a draft must share the target's tokenizer"
            )
        if cfg.max_window:
            raise ValueError(
                "a draft model needs the target's whole context; this target attends only to "
                f"a sliding window of {cfg.max_window} (its old blocks are freed)"
            )
        max_len = min(cfg.max_position_embeddings, config.max_model_len or 1 << 30)
        weights = quant.prepare(loaded.weights, self.quantization, self.device)
        kernels = model_kernels(backend, dcfg, self.device)
        model = Model(
            dcfg, weights, self.device, self.dtype, max_len + 1, kernels,
            activations=config.cpu_activations,
        )  # fmt: skip
        log.info(
            "draft model %s: %d layers, %.1f MB of weights",
            *(path.name, dcfg.num_layers, model.weight_bytes / 1e6),
        )
        return model, model_display_name(path)

    def _model_and_pool(
        self,
        loaded: LoadedModel,
        kernels: ModelKernels | None,
        draft: tuple[Model, str] | None = None,
    ) -> tuple[Model, int]:
        """The model on its device, and how many KV blocks fit: on CUDA what free memory
        leaves once a step has run; on the CPU the configured byte budget. With a draft
        model, its KV cache has as many blocks: the pool's memory is split between them."""
        cfg, config = loaded.config, self.config
        share = 1.0
        if draft is not None:
            mine = bytes_per_block(cfg, self.block_size, self.dtype)
            share = mine / (mine + bytes_per_block(draft[0].cfg, self.block_size, self.dtype))
        weights = quant.prepare(loaded.weights, self.quantization, self.device)
        max_len = min(
            cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings
        )
        if self.device.type == "cuda":
            free_before, _ = torch.cuda.mem_get_info(self.device)
            model = self._model(weights, max_len, kernels)
            num_blocks = num_blocks_from_free_memory(model, config, max_len, free_before)
            num_blocks = max(2, int(num_blocks * share))
        else:
            check_kv_budget(config.kv_cache_bytes)  # (the weights are in memory by now)
            num_blocks = num_blocks_for_budget(
                cfg,
                self.block_size,
                self.dtype,
                config.kv_cache_bytes,
                None if draft is None else draft[0].cfg,
            )
            max_len = min(max_len, (num_blocks - 1) * self.block_size)
            model = self._model(weights, max_len, kernels)
        self.model_max_len = max_len
        return model, num_blocks

    def _model(
        self, weights: dict[str, quant.Weight], max_len: int, kernels: ModelKernels | None
    ) -> Model:
        return Model(
            self.model_config, weights, self.device, self.dtype, max_len + 1, kernels,
            activations=self.config.cpu_activations,
        )  # fmt: skip

    def _init_metrics(self, loaded: LoadedModel) -> None:
        m = self.metric_labels
        metrics.kv_blocks_total.labels(**m).set(self.num_blocks)
        # A weak reference: the metric registry is global and must not keep the engine
        # (its weights and KV cache) alive after its owner drops it.
        ref = weakref.ref(self)
        metrics.kv_blocks_used.labels(**m).set_function(
            lambda: e._blocks_in_use() if (e := ref()) is not None else 0
        )
        held = (
            torch.cuda.memory_allocated()
            if self.device.type == "cuda"
            else self.model.weight_bytes + self.kv_cache.nbytes
        )
        metrics.weight_bytes.labels(**m).set(self.model.weight_bytes)
        self._steps_counted = {
            o: metrics.steps.labels(overlapped=str(o).lower(), **m) for o in (False, True)
        }
        metrics.device_memory_used.labels(**m).set(held)
        # Counters read 0 from the start: a series that appears at 1 loses its first
        # event to rate() and increase() (an alert on resets would miss the first).
        metrics.engine_resets.labels(**m)
        for code in ("INVALID_ARGUMENT", "INTERNAL"):
            metrics.failed_requests.labels(code=code, **m)
        # So do the step histograms (their _count is a counter: steps per second).
        for kind in ("prefill", "decode", "mixed"):
            metrics.step_duration.labels(kind=kind, **m)
        metrics.tokens_per_step.labels(**m)
        metrics.seqs_per_step.labels(**m)

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
            weight_bytes=self.model.weight_bytes,
            quantization=self.quantization or "",
            sliding_window=cfg.max_window or 0,
            hidden_size=cfg.hidden_size,
            kv_cache_bytes=self.kv_cache.nbytes,
            bos_token_id=-1 if cfg.bos_token_id is None else cfg.bos_token_id,
            attention_backend=self.model.attention.name,
            draft_model=self.drafter.name if self.drafter is not None else "",
            max_speculative_tokens=self.config.max_speculative_tokens,
            vocab_fingerprint=cfg.vocab_fingerprint,
            weights_fingerprint=self.weights_fingerprint,
        )

    def drop_requests(self, why: str = "reset") -> None:
        """Forget every request (their KV slots are free to overwrite)."""
        for state in self.requests.values():
            state.span.end(error=why)
        self.requests.clear()
        self.runner.release_all()
        self._unsettled.clear()
        self._last_end = None
        self.failed_alone.clear()
        if self.drafter is not None:
            self.drafter.reset()

    def reset(self, failed: bool = False) -> None:
        """Forget every request and zero the counters; `failed`: after a step raised
        (counted in num_resets)."""
        self.drop_requests()
        c = self.counters
        self.counters = pb.StatsResponse(
            num_failed_requests=c.num_failed_requests, num_resets=c.num_resets + failed
        )
        if failed:
            metrics.engine_resets.labels(**self.metric_labels).inc()

    def stats(self) -> pb.StatsResponse:
        s = pb.StatsResponse()
        s.CopyFrom(self.counters)
        s.num_active_requests = len(self.requests)
        return s

    def warmup(self) -> None:
        """One tiny forward so the first real step does not pay for lazy initialisation."""
        meta = AttentionMetadata.decodes(
            torch.zeros(1, dtype=torch.long, device=self.device),
            torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            [1],
            self.block_size,
        )
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.device.type == "cuda" and self.model.attention.name == "triton":
            from compute_plane.kernels import cache_ops

            # its CuPy kernels compiled and run once now, not in a step (or a graph's
            # capture); where they fail, a WARNING and torch's path from now on
            cache_ops.cupy_works(self.device)
        self._choose_fused_rows()
        hidden = self.model.forward(zero, zero, meta, self.kv_cache.layers)
        self.model.logits(hidden)
        if self.graphs is not None:
            self.graphs.capture()
        if self.pieces is not None:
            self.pieces.capture()
        _return_freed_memory()  # the caller has dropped the loaded weights by now

    def _set_dependent_launch(self, backend: str) -> bool:
        """--pdl: whether this process launches the Triton kernels as programmatic
        dependents (kernels.set_dependent_launch; before any kernel is tuned or a graph
        captured). Hopper (compute capability 9.0) or later, on the Triton path."""
        mode = self.config.pdl
        able = self.device.type == "cuda" and backend == "triton"
        if able:
            able = torch.cuda.get_device_capability(self.device) >= (9, 0)
        if mode == "on" and not able:
            raise ValueError(
                "--pdl on needs the Triton path on a Hopper or later GPU (compute capability "
                "9.0+); use auto or off"
            )
        on = able and mode != "off"
        if backend == "triton":  # (the flag is the process's: the Triton kernel set's alone)
            from compute_plane.kernels import set_dependent_launch

            set_dependent_launch(on)
        return on

    def _choose_fused_rows(self) -> None:
        """Model.fused_rows per --fused-linear (before any decode graph is captured)."""
        model, mode = self.model, self.config.fused_linear
        if model.fused_norm_linear is None or mode == "off":
            return
        from compute_plane.kernels import fused_linear

        if mode == "on":
            model.fused_rows = fused_linear.MAX_ROWS
            return
        if self.device.type != "cuda":
            return

        def dense(w: object) -> torch.Tensor | None:
            return w if isinstance(w, torch.Tensor) else None

        # every layer's weights in turn, as a step reads them (so timed beyond the L2)
        layers = []
        for la in model.layers:
            qkv, gate_up = dense(la.qkv), dense(la.gate_up)
            if qkv is None or gate_up is None:  # FP8/INT8 weights keep their own kernels
                return
            o = dense(la.o) if model.rows_linear is not None else None
            # down fused with SiLU·up where the model has it and the weight is dense
            down = dense(la.down) if model.fused_silu_linear is not None else None
            layers.append(
                fused_linear.LayerLinears(
                    la.input_norm, qkv, o, la.mlp_norm, gate_up, down, la.qkv_bias
                )
            )
        try:
            model.fused_rows, self.fused_linear_timings = fused_linear.fused_rows_faster(
                layers, self.model_config.rms_norm_eps
            )
        except Exception:  # a kernel that fails to build, run or agree here: the separate ones
            log.exception("the fused small-batch linears failed their start-up check; not used")
            model.fused_rows = 0
            return
        log.info(
            "fused small-batch linears for steps of at most %d tokens (µs per layer: %s)",
            model.fused_rows, self.fused_linear_timings,
        )  # fmt: skip

    def step(self, req: pb.StepRequest) -> pb.StepResult:
        """Run one step. Raises StepRejected (no state changed) for a malformed step; a
        request with bad fields, or one that raises while the others compute, fails alone
        (`StepResult.failed`)."""
        return self.finish(self.launch(req))

    def launch(self, req: pb.StepRequest) -> Launched:
        """Validate the step, update the requests and queue its forward; `finish` it (in
        launch order). A step launched before the last one finished takes that step's
        samples on the device where it can; where it needs them on the host (penalties,
        proposals, a request raising) it waits for them first."""
        rows, failures = self.validator.validate(req, self.requests, self.failed_alone)
        if self._unsettled and (req.proposals or any(st.sampling.penalised for _, st, _ in rows)):
            self._settle_all()  # (penalties count the output tokens on the host)
        for rid in req.finished_ids:
            self.failed_alone.pop(rid, None)
            self.runner.release(rid)
            if (gone := self.requests.pop(rid, None)) is not None:
                _log_request("request released", rid)
                _end_span(gone)
            if self.drafter is not None:
                self.drafter.forget(rid)
        for rid, state, _ in rows:
            self.requests[rid] = state  # new requests; continuing ones are already there
        for n in req.new_requests:
            if n.request_id not in self.requests:
                continue  # failed validation
            _log_request(f"request added: {len(n.token_ids)} tokens", n.request_id)
            if self.drafter is not None:
                self.drafter.forget(n.request_id)  # (re-sent: its draft KV is recomputed)
            if n.traceparent:
                self.requests[n.request_id].span = _start_span(n)
        for c in req.continuing:
            if (held := self.requests.get(c.request_id)) is not None:  # else failed before
                held.block_ids.extend(c.new_block_ids)
        launched = Launched(pb.StepResult(step_id=req.step_id))
        for f in failures:
            self._fail(f, launched.result)
        if rows:
            overlapped = bool(self._unsettled)
            masks = {m.request_id: m for m in req.masks}
            todo = [Row(rid, st, st.num_computed_tokens, n, masks.get(rid)) for rid, st, n in rows]
            if req.proposals:
                self._propose(todo, req.proposals)
            self._run(todo, launched)
            # Counted as the step histograms observe it: a step that ran a forward (one
            # that only releases requests, or whose every request failed, runs none).
            self._steps_counted[overlapped].inc()
        self.counters.num_steps += 1
        self.counters.num_requests_added += len(req.new_requests)
        return launched

    def finish(self, launched: Launched) -> pb.StepResult:
        """The launched step's result, once its samples are on the host."""
        self._settle(launched)
        result = launched.result
        if launched.samples is not None and launched.out is None:
            # Its samples were dropped (a Reset while it ran): no result to give.
            result.error.code = "ABORTED"
            result.error.message = "the compute plane was reset while this step ran"
            return result
        if launched.prompt_logprobs is not None:
            result.prompt_logprobs.extend(launched.prompt_logprobs.messages())
            launched.prompt_logprobs = None
        if launched.timing is not None:
            (start, mid, end), kind, before = launched.timing
            end.synchronize()  # (returns at once: the samples' copy, after it, has ended)
            result.forward_ns = int(start.elapsed_time(mid) * 1e6)
            result.sample_ns = int(mid.elapsed_time(end) * 1e6)
            if before is not None:  # (ended before `start`, on the same stream)
                result.device_idle_ns = max(0, int(before.elapsed_time(start) * 1e6))
            seconds = (result.forward_ns + result.sample_ns) / 1e9
            metrics.step_duration.labels(kind=kind, **self.metric_labels).observe(seconds)
            launched.timing = None
        if (out := launched.out) is not None:
            for i, r in enumerate(launched.rows if out.logprobs is not None else ()):
                spec = r.state.sampling
                if spec.logprobs or spec.top_logprobs:
                    self._add_logprobs(
                        result, r.request_id, out, i, spec.logprobs, spec.top_logprobs
                    )
            result.sampled_ids.extend(r.request_id for r in launched.rows)
            result.sampled_token_ids.extend(out.token_ids)
            self.counters.num_sampled_tokens += len(out.token_ids)
            launched.out = None
            launched.samples = None
        return result

    def _settle(self, launched: Launched) -> None:
        """Write the step's deferred samples over its requests' PENDING tokens."""
        if launched not in self._unsettled:
            return
        self._unsettled.remove(launched)
        assert launched.samples is not None
        launched.out = launched.samples.to_host()
        for r, t in zip(launched.rows, launched.out.token_ids, strict=True):
            r.state.token_ids[r.start + r.count] = t
        self.runner.taken(launched.samples)

    def _settle_all(self) -> None:
        while self._unsettled:
            self._settle(self._unsettled[0])

    # ------------------------------------------------------------- compute
    def _propose(self, rows: list[Row], proposals: Iterable[pb.Proposal]) -> None:
        """Give each row with a proposal its draft tokens (the control plane's, or the draft
        model's), appended to its tokens while the step runs (`_take_samples` settles them)."""
        by_id = {r.request_id: r for r in rows}
        drafting: list[tuple[Row, int]] = []
        for p in proposals:
            if (r := by_id.get(p.request_id)) is None:
                continue  # failed validation alone
            if p.token_ids:
                r.draft = list(p.token_ids)
            else:
                drafting.append((r, p.num_draft_tokens))
        if drafting and self.drafter is not None:
            self.drafter.propose(drafting)
        for r in rows:
            if r.draft:
                r.state.token_ids.extend(r.draft)
                r.count += len(r.draft)

    def _fail(self, f: Failure, result: pb.StepResult) -> None:
        """Fail one request alone: forget it and report it in the step's result. It stays
        failed until a step releases it (`failed_before` of StepValidator.validate): a
        step planned before the control plane knew reports it again, uncounted."""
        result.failed.add(request_id=f.request_id, code=f.code, message=f.message)
        if f.request_id in self.failed_alone:
            return
        self.failed_alone[f.request_id] = f
        self.runner.release(f.request_id)
        if (state := self.requests.pop(f.request_id, None)) is not None:
            state.span.end(error=f.message)
        request_id, choice = split_choice_id(f.request_id)
        log.warning(
            "request failed (%s): %s",
            *(f.code, f.message),
            extra={"request_id": request_id, "choice": choice},
        )
        self.counters.num_failed_requests += 1
        metrics.failed_requests.labels(code=f.code, **self.metric_labels).inc()

    def _isolate(self, rows: list[Row], result: pb.StepResult) -> tuple[list[Row], StepOutput]:
        """The batch raised: run each request alone, fail those that raise alone, run the
        rest together. When every one raises the fault is the engine's: re-raise.
        (Running a request again rewrites the same K/V; seeded sampling is positional.)"""
        self._settle_all()
        good, bad = [], []
        for r in rows:
            try:
                self.runner.run([r])
                good.append(r)
            except Exception as e:
                bad.append((r, e))
        if not good:
            raise bad[0][1]
        for r, err in bad:
            log.error("a request raised in a step", exc_info=err)
            message = f"computing this request failed: {type(err).__name__}: {err}"
            self._fail(Failure(r.request_id, "INTERNAL", message), result)
        return good, self.runner.run(good, self.capture_logits)

    def _run(self, rows: list[Row], launched: Launched) -> None:
        # Decodes first, then rows with a proposal (k + 1 one-token queries), then prefill
        # chunks (stable: in the step's order otherwise).
        rows.sort(key=lambda r: 0 if r.count == 1 else 1 if r.draft else 2)
        result = launched.result
        try:
            out = self.runner.run(rows, self.capture_logits, defer=True)
        except Exception:
            if len(rows) == 1:
                raise  # alone: a request or the engine; the control plane decides
            rows, out = self._isolate(rows, result)
        if out.logits_by_row is not None:
            for r, lg in zip(rows, out.logits_by_row, strict=True):
                self.captured_logits.setdefault(r.request_id, []).append(lg)
        if out.sampled is not None:
            self._take_samples(out.sample_rows, out.sampled, result)
        elif out.deferred is not None:
            launched.rows = out.sample_rows
            for r in launched.rows:
                r.state.token_ids.append(PENDING)
            launched.samples = out.deferred
            self._unsettled.append(launched)
        launched.prompt_logprobs = out.prompt_logprobs  # (read when the step finishes)
        c = self.counters
        for r in rows:
            np_ = r.state.num_prompt_tokens
            prompt_part = max(0, min(np_, r.start + r.count) - r.start)
            c.num_prompt_tokens_computed += prompt_part
            c.num_output_tokens_computed += r.count - prompt_part
            if r.draft is None:
                r.state.num_computed_tokens += r.count
            else:  # the last known token and the accepted drafts; the new one is not
                r.state.num_computed_tokens = len(r.state.token_ids) - 1
        # A decode computes its last token, and with a proposal the drafts after it.
        decodes = sum(1 for r in rows if r.count == 1 + len(r.draft or ()))
        kind = "decode" if decodes == len(rows) else "prefill" if decodes == 0 else "mixed"
        m = self.metric_labels
        if out.device_times is not None:  # timed on the device: known once it finished
            launched.timing = (out.device_times, kind, self._last_end)
            self._last_end = out.device_times[2]
        else:
            self._last_end = None  # (device work that no event bounds came in between)
            seconds = (out.forward_ns + out.sample_ns) / 1e9
            metrics.step_duration.labels(kind=kind, **m).observe(seconds)
        metrics.tokens_per_step.labels(**m).observe(out.num_tokens)
        metrics.seqs_per_step.labels(**m).observe(len(rows))
        result.num_tokens = out.num_tokens
        result.num_seqs = len(rows)
        result.forward_ns = out.forward_ns
        result.sample_ns = out.sample_ns
        result.prepare_ns = out.prepare_ns

    def _take_samples(self, rows: list[Row], out: SampleOutput, result: pb.StepResult) -> None:
        """Append each row's sampled token to its request; logprobs where asked. A row with
        a proposal keeps the proposed tokens its samples reproduce and the first sample
        that differs (or the one after the last proposal)."""
        sampled_tokens: list[int] = []
        c = self.counters
        accepted = 0  # proposed tokens kept, over the rows
        i = 0  # the row's first entry in `out` (a row with k proposals has k + 1)
        for r in rows:
            st = r.state
            if r.draft:
                k = len(r.draft)
                base = len(st.token_ids) - k
                samples = out.token_ids[i : i + k + 1]
                a = accepted_length(samples, r.draft)
                del st.token_ids[base:]
                st.token_ids.extend(samples[: a + 1])
                result.accepted.add(request_id=r.request_id, token_ids=samples[:a], num_proposed=k)
                c.num_proposed_tokens += k
                accepted += a
                if self.drafter is not None:
                    self.drafter.verified(r.request_id, base, a)
                entries = range(i, i + a + 1)
                i += k + 1
            else:
                st.token_ids.append(out.token_ids[i])
                entries = range(i, i + 1)
                i += 1
            sampled_tokens.append(st.token_ids[-1])
            spec = st.sampling
            if spec.logprobs or spec.top_logprobs:
                for j in entries:
                    self._add_logprobs(
                        result, r.request_id, out, j, spec.logprobs, spec.top_logprobs
                    )
        result.sampled_ids.extend(r.request_id for r in rows)
        result.sampled_token_ids.extend(sampled_tokens)
        c.num_sampled_tokens += len(rows) + accepted
        c.num_accepted_tokens += accepted

    @staticmethod
    def _add_logprobs(
        result: pb.StepResult, rid: str, out: SampleOutput, i: int, logprob: bool, top: int
    ) -> None:
        tr = result.results.add(request_id=rid, token_id=out.token_ids[i])
        if logprob and out.logprobs is not None:
            tr.logprob = out.logprobs[i]
        if top and out.top_ids is not None and out.top_logprobs is not None:
            for tid, lp in zip(out.top_ids[i][:top], out.top_logprobs[i], strict=False):
                if lp == -math.inf:  # banned (a grammar's mask, min_tokens): not a choice,
                    break  # and the rest, most likely first, are banned too
                tr.top_logprobs.add(token_id=tid, logprob=lp)
