"""Prometheus metrics of the compute plane (served on their own port, default 8002)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

L = ("model_name",)

step_duration = Histogram(
    "hetero_compute_step_duration_seconds",
    "Forward + sampling time of one step, by kind (prefill, decode, mixed)",
    (*L, "kind"),
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
tokens_per_step = Histogram(
    "hetero_compute_tokens_per_step",
    "Tokens computed in one step",
    L,
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
)
seqs_per_step = Histogram(
    "hetero_compute_seqs_per_step",
    "Requests in one step",
    L,
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
kv_blocks_total = Gauge(
    "hetero_compute_kv_blocks_allocated", "KV blocks in the cache (null block included)", L
)
kv_blocks_used = Gauge(
    "hetero_compute_kv_blocks_used", "KV blocks in the page tables of active requests", L
)
device_memory_used = Gauge(
    "hetero_compute_device_memory_used_bytes",
    "Device memory held: weights + KV cache (CUDA: allocator's figure)",
    L,
)
weight_bytes = Gauge(
    "hetero_compute_weight_bytes",
    "Bytes the model's weights take in memory (quantized weights: their codes and scales)",
    L,
)
model_load_seconds = Gauge(
    "hetero_compute_model_load_seconds", "Time to load and warm up the model", L
)
failed_requests = Counter(
    "hetero_compute_failed_requests",
    "Requests a step failed alone (bad fields: INVALID_ARGUMENT; raised: INTERNAL)",
    (*L, "code"),
)
engine_resets = Counter(
    "hetero_compute_engine_resets",
    "Whole-engine resets after a step raised (every request it held is dropped)",
    L,
)
steps = Counter(
    "hetero_compute_steps",
    "Steps launched that ran a forward; overlapped=true: launched before the previous "
    "step's samples were taken (on a GPU: while it computed)",
    (*L, "overlapped"),
)
