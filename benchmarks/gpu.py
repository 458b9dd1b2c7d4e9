"""GPU benchmark: decode-kernel bandwidth, model step time vs its memory bound, throughput.

    python -m benchmarks.gpu                       # writes docs/perf/gpu.json
    python -m benchmarks.gpu --hf                  # also HF transformers generate, same workload

Five parts, each against what the hardware allows:

1. **Decode attention kernel**: bytes of K/V it must read / its time, against the
   device-to-device copy bandwidth measured in the same run (the practical peak).
   **Prefill attention kernel**: TFLOP/s of its causal dots on bf16 operands (tensor
   cores), and on fp32 copies as before ([M]) (`prefill_kernel`).
2. **Model decode step** (CUDA graph replay, batch 1, 64 and 256): its time against
   (weight bytes + K/V bytes) / copy bandwidth, the least a memory-bound step can take,
   and the kernels a replay runs (`kernels`, from torch's profiler); also with the LM
   head and a greedy choice after the replay (`with_logits_ms`), as a step runs them.
3. **Throughput**: 256 requests, prompts and outputs uniform in 100-1024 tokens,
   EOS ignored, through `OfflineLLM` (scheduler + engine in one process), then through
   the path users deploy: a compute-plane process driven over gRPC by a control-plane
   process with the default flags (on CUDA: async scheduling two steps ahead, overlapped
   steps), then one step ahead (`--steps-ahead 1`, the default before 2026-11-26), then
   planning one step at a time (`--no-async-scheduling`), then with the compute plane's
   overlapped steps off (`--overlap-steps off`)
   (`paths.<in_process|grpc|grpc_one_step_ahead|grpc_one_step_at_a_time|grpc_no_overlap>
   .output_tok_s`, and each gRPC path's ratio to in-process).
4. **Quantized weights** (`--quantization fp8|int8`, [L]): the same model with its layer
   matrices in FP8 (`torch._scaled_mm`, activations per token) and weight-only INT8:
   in-process throughput on the same workload and the decode step at batch 1/64/256,
   each against bf16 (`quantized.<fp8|int8>`), and the logits of a fixed prompt (prefill
   of 64 tokens, then 16 more one a step) against bf16's: max abs difference over the max |logit|, the
   stated tolerance being 0.1 for fp8 and 0.02 for int8 (`logits_ok`).

5. **Piecewise CUDA graphs** (`--parts mixed`, not run by default): the steps the decode
   graphs leave (a prefill chunk, alone or with decodes at context 512, up to 2048
   tokens) eagerly and by the piecewise graphs, back to back and one at a time, with the
   largest difference of their hidden states; then the workload in process with graphs
   at every size and with none, each engine on its own, its forwards timed by path
   (`mixed.<all_sizes|off>`).

The parts run in that order (`--parts`, 4 being `quantized`, 5 `mixed`); the report is written after
each, and one that raises is recorded under `errors` while the next runs, so one call on
a lent GPU keeps all it could measure.

The model is randomly initialised with Qwen3-0.6B's shape (28 layers, hidden 1024,
16 query / 8 KV heads of 128, vocabulary 151936, tied embeddings), written as a
safetensors folder with a word-level tokenizer of the same vocabulary, so nothing
is downloaded. Random weights change no kernel's cost.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import PRESETS, machine, make_workload, preset_dict

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}


def write_random_model(
    folder: Path, cfg: dict[str, Any] = QWEN3_0_6B, seed: int = 0, device: str = "cuda"
) -> Path:
    """A safetensors folder of random weights in `cfg`'s shape, with a word-level tokenizer
    (drawn on `device`)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    hidden, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std
        return t.to(torch.bfloat16).cpu()

    def norm(n: int) -> torch.Tensor:
        return (1 + rand(n, std=0.1).float()).to(torch.bfloat16)

    w = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], hidden),
        "model.norm.weight": norm(hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(h * d, hidden),
            p + "self_attn.k_proj.weight": rand(kvh * d, hidden),
            p + "self_attn.v_proj.weight": rand(kvh * d, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, h * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
        }
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def cuda() -> bool:
    return torch.cuda.is_available()


def release_memory() -> None:
    """Collect, and give the CUDA cache back; a context an earlier part left broken raises
    here, which is printed and passed over (the next parts may not need this process's)."""
    gc.collect()
    try:
        torch.cuda.empty_cache()
    except Exception:
        traceback.print_exc()


def free_memory_gb() -> float:
    """GPU memory free now, GB (what a compute plane started now can size its KV pool in)."""
    return round(torch.cuda.mem_get_info()[0] / 1e9, 1)


def _time_cuda(fn: Any, iters: int = 50, warmup: int = 5) -> float:
    """Mean seconds per call, by CUDA events around `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * (1 << 30) / t


def kernel_bandwidth(peak: float) -> list[dict[str, Any]]:
    """Decode attention over bf16 caches in Qwen3-0.6B's head shape, several batch x context."""
    from compute_plane.kernels.decode_attention import choose_num_splits, paged_decode_attention

    h, kvh, d, bs = 16, 8, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, ctx in ((1, 8192), (1, 32768), (16, 4096), (64, 2048), (256, 1024)):
        blocks_each = -(-ctx // bs)
        n = batch * blocks_each + 1
        k = torch.randn(n, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        perm = 1 + torch.randperm(n - 1, device="cuda")  # scattered blocks, as in serving
        tables = perm.view(batch, blocks_each).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
        splits = choose_num_splits(batch, kvh, ctx, sms)
        out = torch.empty_like(q)

        def run() -> None:
            paged_decode_attention(q, k, v, tables, lens, d**-0.5, splits, out=out)  # noqa: B023

        t = _time_cuda(run)
        kv_bytes = 2 * batch * ctx * kvh * d * 2
        rows.append(
            {
                "batch": batch,
                "context": ctx,
                "splits": splits,
                "us": round(t * 1e6, 1),
                "GB_per_s": round(kv_bytes / t / 1e9, 1),
                "of_copy_bandwidth": round(kv_bytes / t / peak, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    torch.cuda.empty_cache()
    return rows


def prefill_kernel() -> list[dict[str, Any]]:
    """Prefill attention over bf16 caches in Qwen3-0.6B's head shape: TFLOP/s of the causal
    dots with bf16 operands on tensor cores, and with the fp32 copies (tf32) it used before."""
    from compute_plane.kernels.prefill_attention import paged_prefill_attention

    h, kvh, d, bs = 16, 8, 128, 16
    rows = []
    for chunks, chunk, prefix in ((1, 2048, 0), (4, 512, 0), (8, 256, 1024)):
        blocks_each = -(-(prefix + chunk) // bs)
        n = chunks * blocks_each + 1
        k = torch.randn(n, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = (1 + torch.randperm(n - 1, device="cuda")).view(chunks, blocks_each)
        tables = tables.to(torch.int32)
        lens = torch.full((chunks,), prefix + chunk, dtype=torch.int32, device="cuda")
        starts = torch.arange(0, chunks * chunk + 1, chunk, dtype=torch.int32, device="cuda")
        q = torch.randn(chunks * chunk, h, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        # Two dots of 2 * d flops per (query, key seen) pair and head.
        pairs = chunks * sum(prefix + j + 1 for j in range(chunk))
        flops = 4 * d * h * pairs
        row: dict[str, Any] = {"chunks": chunks, "chunk": chunk, "prefix": prefix}
        for name, native in (("bf16", True), ("fp32_copies", False)):
            run = functools.partial(
                paged_prefill_attention, q, k, v, tables, lens, starts, chunk, d**-0.5,
                out=out, native=native,
            )  # fmt: skip
            t = _time_cuda(run, iters=20)
            row[f"{name}_us"] = round(t * 1e6, 1)
            row[f"{name}_TFLOP_s"] = round(flops / t / 1e12, 1)
        row["bf16_speedup"] = round(row["fp32_copies_us"] / row["bf16_us"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return rows


def _decode_graph_time(engine: Any, batch: int, ctx: int, logits: bool = False) -> float:
    """Seconds per replay of the decode graph of `batch`, each sequence `ctx` tokens long
    (`logits`: with the LM head and a greedy choice after it, as a step runs them)."""
    graphs = engine.graphs
    assert graphs is not None, "CUDA graphs are off"
    size = next(b for b in graphs.sizes if b >= batch)
    need = -(-ctx // engine.block_size)
    assert size * need < engine.num_blocks, "KV pool too small for this probe"
    tables = 1 + torch.arange(size * need, dtype=torch.int32, device="cuda").view(size, need)
    graphs.tables.zero_()
    graphs.tables[:size, :need].copy_(tables)
    graphs.seq_lens[:size].fill_(ctx)
    graphs.positions[:size].fill_(ctx - 1)
    graphs.slots[:size].copy_(tables[:, -1].long() * engine.block_size)
    if not logits:
        return _time_cuda(graphs.graphs[size].replay, iters=30)

    def step() -> None:
        graphs.graphs[size].replay()
        engine.model.logits(graphs.outputs[size][:batch]).argmax(-1)

    return _time_cuda(step, iters=30)


def _graph_kernels(engine: Any, batch: int) -> tuple[int | None, list[dict[str, Any]]]:
    """Kernels one replay of the decode graph of `batch` runs (torch's profiler), and the
    ten that take the most device time in it (name, launches, total µs); None and [] where
    the profiler does not see into graphs."""
    graphs = engine.graphs
    size = next(b for b in graphs.sizes if b >= batch)
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs.graphs[size].replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    except Exception as e:  # (a profiler that cannot run here costs this figure only)
        print(f"kernel count unavailable: {e}", flush=True)
        return None, []
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
    times = [
        {"kernel": name[:120], "launches": len(us), "total_us": round(sum(us), 1)}
        for name, us in top
    ]
    return len(kernels) or None, times


def step_times(engine: Any, peak: float, both_launches: bool = False) -> list[dict[str, Any]]:
    """The decode graph's replay at batch 1, 64 and 256 (context 512) against its memory
    bound, with the kernels it runs; each row says how the kernels were launched (`pdl`:
    as programmatic dependents, `--pdl`; `preload`: the matrix-vector linears tuned among
    the configs that read their first weight tile before they wait, as with `--pdl`).
    `both_launches`: on a GPU that takes dependent launches, the same rows each other way
    (the graphs captured again), the engine's own way first; each row with a counterpart of
    the same linears launched the other way has `same_output`: whether their batch-1
    hidden states are equal bit for bit (the same arithmetic; a launch that read before its
    `griddepcontrol.wait` would differ)."""
    from compute_plane.kernels import fused_linear

    pdl = engine.dependent_launch
    preload = pdl if fused_linear.Preload.only is None else fused_linear.Preload.only
    rows = _step_rows(engine, peak, pdl, preload)
    if not both_launches or torch.cuda.get_device_capability() < (9, 0):
        return rows
    from compute_plane.kernels import set_dependent_launch

    outputs = {preload: _graph_output(engine, 1)}  # by the linears' configs
    ways = [(p, q) for q in (preload, not preload) for p in (pdl, not pdl)][1:]
    try:
        for p, q in ways:
            set_dependent_launch(p)
            fused_linear.Preload.only = q
            engine.graphs.capture()
            out = _graph_output(engine, 1)
            same = {"same_output": bool(torch.equal(outputs[q], out))} if q in outputs else {}
            outputs.setdefault(q, out)
            rows += [r | same for r in _step_rows(engine, peak, p, q)]
    finally:
        set_dependent_launch(pdl)
        fused_linear.Preload.only = None
        engine.graphs.capture()
    return rows


def _graph_output(engine: Any, batch: int, ctx: int = 512) -> torch.Tensor:
    """The decode graph's hidden states for `batch` sequences of `ctx` tokens (as
    `_decode_graph_time` stages them), copied. The step's own K/V slots hold NaN in every
    layer before that replay: a kernel that read them before the rotation wrote them (a
    programmatic dependent that read too early) would make the states NaN."""
    graphs = engine.graphs
    _decode_graph_time(engine, batch, ctx)  # stages the inputs (and replays)
    size = next(b for b in graphs.sizes if b >= batch)
    slots = graphs.slots[:size]
    for layer in engine.kv_cache.layers:
        for cache in layer[:2]:
            cache.view(-1, *cache.shape[2:])[slots] = float("nan")
    graphs.graphs[size].replay()
    torch.cuda.synchronize()
    return graphs.outputs[size][:batch].clone()


def _step_rows(engine: Any, peak: float, pdl: bool, preload: bool) -> list[dict[str, Any]]:
    cfg = engine.model_config
    weight_bytes = engine.model.weight_bytes
    per_token_kv = (
        2
        * cfg.num_layers
        * cfg.num_kv_heads
        * cfg.head_dim
        * engine.kv_cache.layers[0][0].element_size()
    )
    rows = []
    for batch, ctx in ((1, 512), (64, 512), (256, 512)):
        t = _decode_graph_time(engine, batch, ctx)
        with_logits = _decode_graph_time(engine, batch, ctx, logits=True)
        bound = (weight_bytes + batch * ctx * per_token_kv) / peak
        count, top = _graph_kernels(engine, batch)
        rows.append(
            {
                "batch": batch,
                "context": ctx,
                "pdl": pdl,
                "preload": preload,
                "ms": round(t * 1e3, 3),
                "memory_bound_ms": round(bound * 1e3, 3),
                "of_memory_bound": round(bound / t, 3),
                # the graph, then the LM head (eager) and a greedy argmax
                "with_logits_ms": round(with_logits * 1e3, 3),
                "kernels": count,
                "kernel_times": top,  # where a replay's device time goes
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


STATED_LOGIT_TOLERANCE = {"fp8": 0.1, "int8": 0.02}  # max |diff| / max |logit| vs bf16


def _prompt_logits(engine: Any, vocab: int) -> torch.Tensor:
    """Logits at each position of a fixed 80-token sequence: its first 64 tokens in one
    step, then one token a step (the shape of decode steps), the same tokens whatever
    the weights (greedy choices would part ways on near-ties of random weights)."""
    from hetero_proto import compute_pb2 as pb

    engine.capture_logits = True
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, vocab, (80,), generator=gen).tolist()
    blocks = list(range(1, 1 + -(-len(tokens) // engine.block_size)))  # all of them up front
    first = pb.StepRequest(step_id=1)
    first.new_requests.add(
        request_id="probe",
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        num_scheduled_tokens=64,
        block_ids=blocks,
        sampling=pb.SamplingParams(temperature=0.0),
    )
    engine.step(first)
    for k in range(16):  # the prompt's next token each step, as a one-token continuation
        engine.step(pb.StepRequest(step_id=2 + k, decode_ids=["probe"]))
    logits = torch.cat(engine.captured_logits.pop("probe")).float().cpu()
    engine.step(pb.StepRequest(step_id=18, finished_ids=["probe"]))
    engine.capture_logits = False
    return logits


def quantized(
    folder: Path,
    work: Any,
    peak: float,
    kinds: list[str],
    out: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Each of `kinds` against bf16 on the same model: throughput, decode steps, logits,
    into `out`, `save`d after each kind; a kind that raises is recorded as its `error`
    (and where bf16 does, the others have nothing to be compared with)."""
    base: dict[str, Any] = {}
    for kind in ["none", *kinds]:
        key = "bf16" if kind == "none" else kind
        try:
            out[key] = _quantized_kind(folder, work, peak, kind, base)
        except Exception:
            traceback.print_exc()
            out[key] = {"error": _error_line()}
        save()
        release_memory()
        if not base:
            return


def _quantized_kind(
    folder: Path, work: Any, peak: float, kind: str, base: dict[str, Any]
) -> dict[str, Any]:
    """One kind's row; bf16's ("none") also fills `base`, which the others compare with."""
    from benchmarks.offline import run_ours
    from compute_plane.config import ComputeConfig
    from hetero_infer.offline import OfflineLLM

    compute = ComputeConfig(model=str(folder), metrics_port=-1, quantization=kind)
    llm = OfflineLLM(str(folder), compute=compute)
    logits = _prompt_logits(llm.engine, llm.engine.model_config.vocab_size)
    fig = run_ours(llm, work, warmup=len(work))
    row: dict[str, Any] = {
        "weight_bytes": llm.engine.model.weight_bytes,
        "output_tok_s": fig["output_tokens_per_s"],
        "decode_step": step_times(llm.engine, peak),
    }
    if kind == "none":
        base |= {"logits": logits, **row}
    else:
        diff = (logits - base["logits"]).abs().max().item()
        rel = diff / base["logits"].abs().max().item()
        row |= {
            "vs_bf16": round(row["output_tok_s"] / base["output_tok_s"], 3),
            "logits_max_abs_diff": round(diff, 4),
            "logits_diff_of_max": round(rel, 4),
            "logits_ok": rel <= STATED_LOGIT_TOLERANCE[kind],
            "greedy_agree": float((logits.argmax(-1) == base["logits"].argmax(-1)).float().mean()),
        }
    print(kind, json.dumps({k: v for k, v in row.items() if k != "decode_step"}), flush=True)
    return row


# (decodes at context 512, new tokens of one prefill chunk): steps the decode graphs do not
# take, from a lone prompt to a full step of max_num_batched_tokens (2048)
MIXED_SHAPES = [
    (0, 16), (1, 63), (0, 128), (8, 120), (1, 255), (32, 224), (1, 511), (64, 448),
    (128, 384), (256, 256), (1, 1023), (256, 768), (0, 2048), (256, 1792),
]  # fmt: skip


def mixed_steps(engine: Any, ctx: int = 512, iters: int = 20) -> list[dict[str, Any]]:
    """Per MIXED_SHAPES step: ms per step, steps run back to back (so a step costs its
    host launches or its device time, whichever is longer, as in a busy engine), eagerly
    and by the piecewise graphs; host_ms: the time the host took to launch them (the
    device still busy after); alone_ms: each step launched and waited for on its own;
    and the largest difference of the hidden states over the
    largest |value|. The cache holds whatever it holds: attention's cost does not
    depend on the values."""
    from compute_plane.attention import AttentionMetadata

    pieces = engine.pieces
    assert pieces is not None, "piecewise graphs are off"
    bs, dev = engine.block_size, engine.device
    kv = engine.kv_cache.layers
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for d, c in MIXED_SHAPES:
        n = d + c
        if n > engine.config.max_num_batched_tokens:
            continue
        width = max(-(-ctx // bs), -(-c // bs))
        seqs = d + (1 if c else 0)
        tables = (1 + torch.arange(seqs * width, dtype=torch.int32)).view(seqs, width)
        assert seqs * width < engine.num_blocks, "the pool is too small for the shape"
        positions = [ctx - 1] * d + list(range(c))
        slots = [int(tables[i, p // bs]) * bs + p % bs for i, p in enumerate(positions[:d])]
        slots += [int(tables[d, p // bs]) * bs + p % bs for p in range(c)]
        seq_lens = [ctx] * d + ([c] if c else [])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            block_tables=tables.to(dev),
            seq_lens=seq_lens,
            query_lens=[1] * d + ([c] if c else []),
            num_decodes=d,
            block_size=bs,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, c], dtype=torch.int32, device=dev) if c else None,
        )
        ids = torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).to(dev)
        pos = torch.tensor(positions, device=dev)
        t = pieces.padded_size(n)
        ways: dict[str, Callable[[], torch.Tensor]] = {
            "eager": functools.partial(engine.model.forward, ids, pos, meta, kv)
        }
        if t is not None:
            ways["piecewise"] = functools.partial(pieces.run, t, ids, pos, meta)
        row: dict[str, Any] = {"decodes": d, "chunk": c, "tokens": n, "padded_to": t}
        outs = {}
        for way, fn in ways.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(iters):
                fn()
            launched = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            row[f"{way}_ms"] = round((done - started) * 1e3 / iters, 3)
            row[f"{way}_host_ms"] = round((launched - started) * 1e3 / iters, 3)
            alone = 0.0  # each step on its own: launched, then waited for
            for _ in range(iters):
                started = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                alone += time.perf_counter() - started
            row[f"{way}_alone_ms"] = round(alone * 1e3 / iters, 3)
            outs[way] = fn().float().clone()
        if "piecewise" in outs:
            row["piecewise_vs_eager"] = round(row["eager_ms"] / row["piecewise_ms"], 3)
            diff = (outs["piecewise"] - outs["eager"]).abs().max().item()
            row["hidden_diff_of_max"] = round(diff / outs["eager"].abs().max().item(), 5)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def mixed(folder: Path, work: Any, report: dict[str, Any], save: Callable[[], None]) -> None:
    """The piecewise graphs at every size up to max_num_batched_tokens, and none
    (`--piecewise-graphs 0`), each in an engine of its own (`_mixed_row`); into
    report["mixed"]."""
    out = report["mixed"] = {}
    for key, sizes in (("all_sizes", 2048), ("off", 0)):
        out[key] = {"piecewise_graphs": sizes}
        _mixed_row(folder, work, out[key], save)
        print(key, json.dumps({k: v for k, v in out[key].items() if k != "steps"}), flush=True)
        save()
        release_memory()  # (nothing of the engine is referenced any more)


def _mixed_row(folder: Path, work: Any, row: dict[str, Any], save: Callable[[], None]) -> None:
    """An engine with row["piecewise_graphs"]: its start-up and capture times, the steps
    of MIXED_SHAPES each way (`mixed_steps`, where it has the graphs); then the
    256-request workload in process, first with each forward waited for and timed by the
    path it took (`forwards`: count, ms in all, ms each; its warm-up round included:
    the first process to meet a shape compiles its kernels there), then plainly, warm
    (`output_tok_s`)."""
    from benchmarks.offline import run_ours
    from compute_plane.config import ComputeConfig
    from hetero_infer.offline import OfflineLLM

    compute = ComputeConfig(
        model=str(folder), metrics_port=-1, piecewise_graphs=row["piecewise_graphs"]
    )
    started = time.perf_counter()
    llm = OfflineLLM(str(folder), compute=compute)
    row["engine_start_s"] = round(time.perf_counter() - started, 1)
    engine = llm.engine
    if engine.pieces is not None:
        row["piecewise_capture_s"] = round(engine.pieces.capture_s, 1)
        row["piecewise_capture_by_size"] = engine.pieces.capture_by_size
        row["steps"] = mixed_steps(engine)
        save()
    runner = engine.runner
    plain = runner._forward
    spent = dict.fromkeys(runner.forwards, 0.0)

    def timed(x: Any) -> Any:
        before = dict(runner.forwards)
        torch.cuda.synchronize()
        started = time.perf_counter()
        hidden = plain(x)
        torch.cuda.synchronize()
        path = next(k for k, v in runner.forwards.items() if v != before[k])
        spent[path] += time.perf_counter() - started
        return hidden

    setattr(runner, "_forward", timed)  # noqa: B010 (a method of this instance)
    before = dict(runner.forwards)
    fig = run_ours(llm, work, warmup=len(work))
    del runner._forward  # the class's again
    row["timed_output_tok_s"] = fig["output_tokens_per_s"]
    row["forwards"] = {
        k: {
            "count": v - before[k],
            "ms": round(spent[k] * 1e3, 1),
            "ms_each": round(spent[k] * 1e3 / max(v - before[k], 1), 3),
        }
        for k, v in runner.forwards.items()
    }
    fig = run_ours(llm, work, warmup=1)  # (the round before warmed it up)
    row["output_tok_s"] = fig["output_tokens_per_s"]


def _error_line() -> str:
    """The exception being handled, as its last traceback line."""
    return "".join(traceback.format_exception_only(*sys.exc_info()[:2])).strip()


GRPC_PATHS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("grpc", (), ()),  # the defaults: async scheduling 2 ahead, overlapped steps on CUDA
    ("grpc_one_step_ahead", ("--steps-ahead", "1"), ()),
    ("grpc_one_step_at_a_time", ("--no-async-scheduling",), ()),
    # the compute plane finishing each step before launching the next (as before [M])
    ("grpc_no_overlap", (), ("--overlap-steps", "off")),
]
# The parts, in the order they run, and what each measures: keys of the report, of its
# `paths` and `throughput`, and of `errors` (a part that raised), all dropped when the
# part runs again.
PARTS = {
    "kernels": ("decode_kernel", "prefill_kernel", "kernels"),
    "engine": ("engine_start_s", "engine", "decode_step", "in_process"),
    "grpc": (*(key for key, _, _ in GRPC_PATHS), "free_memory_GB_before_grpc"),
    "quantized": ("quantized",),
    "mixed": ("mixed",),
}
DEFAULT_PARTS = [p for p in PARTS if p != "mixed"]  # (mixed: a device call of its own)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/qwen3-0.6b-random"))
    ap.add_argument("--preset", default="gpu", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf", action="store_true", help="also HF generate, static batches")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("docs/perf/gpu.json"))
    ap.add_argument("--quantizations", default="fp8,int8", help="compared with bf16 ('' to skip)")
    ap.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help="which to run, always in this order (a subset updates the report at --out in\n"
        "place):\n"
        "kernels (attention kernels, copy bandwidth), engine (decode steps, throughput in\n"
        "process), grpc (the gRPC paths), quantized (FP8/INT8 against bf16), mixed\n"
        "(piecewise graphs: other steps each way, throughput with and without; only\n"
        "when named)",
    )
    ap.add_argument(
        "--path-timeout",
        type=float,
        default=300.0,
        help="seconds one gRPC path may take, start-up included (a hung path is recorded\n"
        "as an error and the next one runs)",
    )
    ap.add_argument(
        "--grpc-paths",
        default=",".join(key for key, _, _ in GRPC_PATHS),
        help="the gRPC paths the grpc part runs, in its order (a shorter device call)",
    )
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    wanted = [p for p in args.grpc_paths.split(",") if p]
    if unknown_paths := sorted(set(wanted) - {key for key, _, _ in GRPC_PATHS}):
        ap.error(f"--grpc-paths: unknown {', '.join(unknown_paths)}")
    if unknown := sorted(set(parts) - set(PARTS)):
        ap.error(f"--parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})")
    if not cuda():
        raise SystemExit("benchmarks.gpu needs a CUDA device")
    from benchmarks.offline import run_grpc, run_hf, run_ours
    from hetero_infer.offline import OfflineLLM

    report: dict[str, Any] = {}
    if set(parts) != set(DEFAULT_PARTS) and args.out.is_file():  # update the last report
        report = json.loads(args.out.read_text())
    report |= {"benchmark": "gpu", "machine": machine()}
    if not isinstance(report.get("throughput"), dict):  # (a list before 2026-11-26)
        report["throughput"] = {}
    errors: dict[str, str] = report.setdefault("errors", {})
    paths: dict[str, Any] = report.setdefault("paths", {})
    throughput: dict[str, Any] = report.setdefault("throughput", {})  # each path's figures
    for key in (k for p in parts for k in PARTS[p]):  # this run's parts measure afresh
        for d in (report, errors, paths, throughput):
            d.pop(key, None)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each part, so a cut-short run keeps what it measured
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    def failed(part: str) -> None:
        """A part that raised: its error in the report, and the run goes on."""
        traceback.print_exc()
        errors[part] = _error_line()
        save()

    # First, while the device is sure to be sound: an error that poisons this process's
    # CUDA context (an illegal address in a kernel) ends what it runs later, but the
    # gRPC paths' planes are processes of their own and read the model from disk.
    folder = write_random_model(args.model_dir)
    if "kernels" in parts or "copy_bandwidth_GB_per_s" not in report:
        peak = copy_bandwidth()
        report["copy_bandwidth_GB_per_s"] = round(peak / 1e9, 1)
    else:  # (the ratios of one report share one peak)
        peak = report["copy_bandwidth_GB_per_s"] * 1e9
    print(f"device-to-device copy: {peak / 1e9:.0f} GB/s", flush=True)
    if "kernels" in parts:
        try:
            report["decode_kernel"] = kernel_bandwidth(peak)
            report["prefill_kernel"] = prefill_kernel()
        except Exception:
            failed("kernels")
        save()

    work = make_workload(PRESETS[args.preset], args.seed, vocab=(100, 150000))
    report["workload"] = preset_dict(PRESETS[args.preset]) | {"seed": args.seed}
    if "engine" in parts:
        llm = None
        try:
            started = time.perf_counter()
            llm = OfflineLLM(str(folder))
            report["engine_start_s"] = round(time.perf_counter() - started, 1)
            desc = llm.engine.describe()
            report["engine"] = {
                "dtype": desc.dtype,
                "attention_backend": desc.attention_backend,
                "num_kv_blocks": desc.num_kv_blocks,
                "block_size": desc.block_size,
                "cuda_graphs": llm.engine.graphs is not None,
                # steps of at most this many tokens run the fused small-batch linears (the
                # start-up timing of every layer each way, µs per layer, in
                # fused_linear_timings)
                "fused_rows": llm.engine.model.fused_rows,
                "fused_linear_timings": llm.engine.fused_linear_timings,
                # start-up's graph captures, seconds (the piecewise ones per size: warm-up
                # forward, capture, and of that torch's capture_begin/capture_end)
                "decode_graphs_capture_s": graphs.capture_s
                if (graphs := llm.engine.graphs)
                else None,
                "piecewise_capture_s": pieces.capture_s if (pieces := llm.engine.pieces) else None,
                "piecewise_capture_by_size": pieces.capture_by_size if pieces else None,
            }
            save()
        except Exception:
            failed("engine")
        if llm is not None:
            # The throughput first, each path after an untimed round of every prompt (4
            # tokens each): on the H200 on 2026-11-26 this process's in-process run, after
            # step_times (torch's profiler lists the kernels) and after a round of 16
            # prompts, made 6,769 tok/s, and a run of the same engine later in the same
            # call (the quantized part's bf16 row, before its step_times, with the Triton
            # kernels compiled by then) 13,157.
            try:
                ours = run_ours(llm, work, warmup=len(work))
                throughput["in_process"] = ours
                paths["in_process"] = {"output_tok_s": ours["output_tokens_per_s"]}
                print(json.dumps(ours), flush=True)
            except Exception:
                failed("in_process")
            save()
            try:
                report["decode_step"] = step_times(llm.engine, peak, both_launches=True)
            except Exception:
                failed("decode_step")
            save()
        llm = None  # its KV cache holds most of the GPU: free before the planes start
        release_memory()
    if "grpc" in parts:
        # (the in-process engine's memory must be back: the planes size their pools by it)
        try:
            report["free_memory_GB_before_grpc"] = free_memory_gb()
        except Exception:  # (a context an earlier part poisoned: the planes have their own)
            failed("free_memory_GB_before_grpc")
        for key, control, compute in (p for p in GRPC_PATHS if p[0] in wanted):
            try:
                fig = run_grpc(
                    str(folder), work, compute_args=compute, control_args=control,
                    quiet=False, timeout=args.path_timeout, warmup=len(work),
                )  # fmt: skip
            except Exception:
                failed(key)
                continue
            throughput[key] = fig
            paths[key] = {"output_tok_s": fig["output_tokens_per_s"]}
            if "in_process" in paths:
                ratio = fig["output_tokens_per_s"] / paths["in_process"]["output_tok_s"]
                paths[key]["vs_in_process"] = round(ratio, 3)
            print(json.dumps(fig), flush=True)
            save()
    if "quantized" in parts and args.quantizations:
        report["quantized"] = {}
        quantized(folder, work, peak, args.quantizations.split(","), report["quantized"], save)
        if failed_kinds := [k for k, row in report["quantized"].items() if "error" in row]:
            errors["quantized"] = f"see quantized.<{'|'.join(failed_kinds)}>.error"
    if "mixed" in parts:
        try:
            mixed(folder, work, report, save)
        except Exception:
            failed("mixed")
    if args.hf:
        hf = run_hf(str(folder), work, args.hf_batch_size)
        throughput["hf"] = hf
        if "in_process" in paths:
            ratio = paths["in_process"]["output_tok_s"] / hf["output_tokens_per_s"]
            report["ours_vs_hf"] = round(ratio, 2)
        print(json.dumps(hf), flush=True)
    if not errors:
        del report["errors"]
    save()
    print(f"report: {args.out}" + (f" (errors in {', '.join(errors)})" if errors else ""))
    return report


if __name__ == "__main__":
    sys.exit(1 if main().get("errors") else 0)
