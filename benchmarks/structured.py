"""Structured output's cost: 32 concurrent JSON-schema requests vs 32 free requests of
the same lengths, through the OpenAI API of a three-process stack (bundled model, CPU).

    python -m benchmarks.structured            # writes docs/perf/structured.json

The constrained pass sends 32 chat requests (the 30 schemas of benchmarks.json_schemas,
`response_format` json_schema strict, greedy) at once and records each answer's length.
The free pass sends the same 32 prompts without a grammar, each with max_tokens =
min_tokens = its constrained answer's length and EOS ignored, so both passes generate the
same tokens per request. Prefix caching is off (the passes share prompts). A warm-up of
both shapes first; then the passes alternate, twice each, and the medians are reported:
output tokens/s of each, their ratio, and the control plane's mask time per step (from
its metrics: advancing the step's constrained requests and computing their next masks).
Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.json_schemas import SCHEMAS, TOPICS, prompt
from benchmarks.online import launched
from benchmarks.workload import machine, write_report
from hetero_common.model_path import bundled_gguf

N = 32


def _jobs(offset: int) -> list[tuple[str, dict[str, Any]]]:
    """N (prompt, schema) pairs; `offset` picks other topics for the warm-up."""
    out = []
    for i in range(N):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        out.append((prompt(what, schema, TOPICS[(i + offset) % len(TOPICS)]), schema))
    return out


async def _pass(
    url: str, model: str, jobs: list[tuple[str, dict[str, Any]]], lengths: list[int] | None
) -> tuple[float, list[int]]:
    """Run all at once: (output tokens/s, each answer's length)."""

    async def one(http: httpx.AsyncClient, i: int) -> int:
        text, schema = jobs[i]
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "temperature": 0,
        }
        if lengths is None:
            body["max_tokens"] = 400
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            }
        else:
            body.update(max_tokens=lengths[i], min_tokens=lengths[i], ignore_eos=True)
        r = await http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(http, i) for i in range(len(jobs))))
        wall = time.perf_counter() - t0
    return sum(got) / wall, list(got)


def _mask_metric(metrics_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the control plane's mask-time histogram."""
    text = httpx.get(metrics_url, timeout=10).text
    total = re.search(r"^hetero_structured_output_mask_seconds_sum (\S+)", text, re.M)
    count = re.search(r"^hetero_structured_output_mask_seconds_count (\S+)", text, re.M)
    return (float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0)


def run(model: str) -> dict[str, Any]:
    from hetero_infer.local import free_port

    mport = free_port()
    control = ("--no-enable-prefix-caching", "--metrics-port", str(mport))
    metrics_url = f"http://127.0.0.1:{mport}/metrics"
    with launched(model, control_args=control) as (url, _):
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm = _jobs(1)
        _, warm_lengths = asyncio.run(_pass(url, name, warm, None))
        asyncio.run(_pass(url, name, warm, warm_lengths))
        jobs = _jobs(0)
        constrained, free, masks = [], [], []
        lengths: list[int] = []
        for _ in range(2):
            s0, c0 = _mask_metric(metrics_url)
            rate, got = asyncio.run(_pass(url, name, jobs, None))
            s1, c1 = _mask_metric(metrics_url)
            assert not lengths or got == lengths, "greedy constrained answers changed length"
            lengths = got
            constrained.append(rate)
            masks.append((s1 - s0) / max(c1 - c0, 1))
            free.append(asyncio.run(_pass(url, name, jobs, lengths))[0])
    c, f = statistics.median(constrained), statistics.median(free)
    return {
        "requests": N,
        "output_tokens": sum(lengths),
        "mean_output_tokens": sum(lengths) / N,
        "constrained_output_tok_s": round(c, 1),
        "free_output_tok_s": round(f, 1),
        "ratio": round(c / f, 3),
        "mask_ms_per_step": round(1000 * statistics.median(masks), 3),
        "runs": {"constrained": constrained, "free": free},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled GGUF")
    ap.add_argument("--out", type=Path, default=Path("docs/perf/structured.json"))
    args = ap.parse_args()
    model = args.model or str(bundled_gguf())
    result = run(model)
    report = {"machine": machine(), "model": Path(model).name, **result}
    write_report(args.out, report)
    print(
        f"{N} concurrent, {result['mean_output_tokens']:.0f} tokens each: JSON schema "
        f"{result['constrained_output_tok_s']} tok/s, free {result['free_output_tok_s']} tok/s, "
        f"ratio {result['ratio']}; mask {result['mask_ms_per_step']} ms per step"
    )
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
