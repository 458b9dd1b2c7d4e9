"""Prometheus metrics of the control plane (served on their own port, default 8001).

Names follow Prometheus conventions (base units, `_total` counters); each carries a
`model_name` label. docs/metrics.md maps them to vLLM's.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
L = ("model_name",)
# The step and KV metrics are per compute plane (a control plane drives several).
P = ("model_name", "compute")

requests_running = Gauge("hetero_requests_running", "Requests in the running batch", P)
requests_waiting = Gauge("hetero_requests_waiting", "Requests waiting to be scheduled", P)
kv_cache_usage = Gauge(
    "hetero_kv_cache_usage_ratio", "Fraction of KV blocks held by requests (0..1)", P
)
preemptions = Counter("hetero_preemptions", "Requests preempted by recompute", P)
prefix_queries = Counter(
    "hetero_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", P
)
prefix_hits = Counter("hetero_prefix_cache_hits", "Prompt tokens found in the prefix cache", P)
prompt_tokens = Counter("hetero_prompt_tokens", "Prompt tokens of admitted requests", L)
generation_tokens = Counter("hetero_generation_tokens", "Generated tokens", L)
request_success = Counter(
    "hetero_request_success", "Finished requests by finish reason", (*L, "finished_reason")
)
ttft = Histogram(
    "hetero_time_to_first_token_seconds", "Arrival to first token", L, buckets=LATENCY_BUCKETS
)
itl = Histogram(
    "hetero_inter_token_latency_seconds",
    "Time between consecutive tokens of a request",
    L,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
e2e = Histogram(
    "hetero_e2e_request_latency_seconds", "Arrival to finish", L, buckets=LATENCY_BUCKETS
)
queue_time = Histogram(
    "hetero_request_queue_time_seconds", "Arrival to first scheduled", L, buckets=LATENCY_BUCKETS
)
prefill_time = Histogram(
    "hetero_request_prefill_time_seconds",
    "First scheduled to first token",
    L,
    buckets=LATENCY_BUCKETS,
)
decode_time = Histogram(
    "hetero_request_decode_time_seconds", "First token to finish", L, buckets=LATENCY_BUCKETS
)
constrained_requests = Counter(
    "hetero_structured_output_requests",
    "Requests admitted with a grammar (structured output), by kind",
    (*L, "kind"),
)
# No model_name label: grammars are per tokenizer, and the step loop observes once per step.
grammar_mask_seconds = Histogram(
    "hetero_structured_output_mask_seconds",
    "Time to advance the constrained requests of a step and compute their next masks",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
grammar_compile_seconds = Histogram(
    "hetero_structured_output_compile_seconds",
    "Time to compile a grammar not in the cache",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
grammar_cache_bytes = Gauge(
    "hetero_structured_output_cache_bytes",
    "Estimated bytes of the compiled grammars cached (--grammar-cache-mb caps it)",
)
grammar_cache_evictions = Counter(
    "hetero_structured_output_cache_evictions",
    "Compiled grammars dropped from the cache to keep it under --grammar-cache-mb",
)
# Speculative decoding (vLLM's vllm:spec_decode_* names under our prefix). Mean acceptance
# length = (accepted + drafts) / drafts: tokens a verifying request emits per step.
spec_drafts = Counter(
    "hetero_spec_decode_num_drafts", "Verifications of proposals (one per request per step)", L
)
spec_draft_tokens = Counter("hetero_spec_decode_num_draft_tokens", "Proposed tokens verified", L)
spec_accepted_tokens = Counter(
    "hetero_spec_decode_num_accepted_tokens", "Proposed tokens accepted", L
)
spec_emitted_tokens = Counter(
    "hetero_spec_decode_num_emitted_tokens",
    "Tokens verifications emitted (accepted proposals + the token sampled after them)",
    L,
)
spec_accepted_per_pos = Counter(
    "hetero_spec_decode_num_accepted_tokens_per_pos",
    "Accepted proposals by their position in the proposal (0 = first)",
    (*L, "position"),
)
steps = Counter(
    "hetero_steps",
    "Steps sent to the compute plane; planned_ahead=true: planned while the previous step "
    "ran (async scheduling)",
    (*P, "planned_ahead"),
)
compute_attached = Gauge("hetero_compute_attached", "1 while the compute plane is attached", P)
compute_unfit = Gauge(
    "hetero_compute_unfit",
    "1 while the compute plane is refused for this reason (speculation, shape, vocabulary, "
    "weights, tokenizer: it cannot serve what this control plane is configured for)",
    (*P, "reason"),
)
routed = Counter(
    "hetero_routed_requests",
    "Requests placed on a compute plane, by why: prefix (longest prefix-cache hit), load "
    "(no hit, or the hit's plane was busier by more than route_load_slack), only (one plane "
    "accepts requests), moved (off a compute plane that failed or left)",
    (*P, "reason"),
)


# The series labelled with a compute plane (`compute`), removed when it leaves.
PER_COMPUTE = [
    requests_running, requests_waiting, kv_cache_usage, preemptions, prefix_queries,
    prefix_hits, steps, compute_attached, compute_unfit, routed,
]  # fmt: skip


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value` at the cost of one.

    prometheus_client has no batch observe; in a decode step most running sequences
    see the same inter-token latency, so the step loop observes each distinct value
    once with its count. Falls back to a loop where the histogram's internals differ.
    """
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    for bound, bucket in zip(bounds, buckets, strict=True):
        if value <= bound:
            bucket.inc(count)
            break
