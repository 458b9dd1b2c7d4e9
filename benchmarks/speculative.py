"""Speculative decoding's speed: n-gram (prompt lookup) and draft-model proposals vs none,
through the OpenAI API of a three-process stack (bundled model, CPU), greedy.

    python -m benchmarks.speculative            # writes docs/perf/speculative.json

1. Batch 1: prompts whose answers repeat their input (repeat, edit code, extract, rewrite),
   one request at a time, for: no speculation and n-gram (k = 4, adaptive), alternated over
   ROUNDS rounds on two stacks (the ratio of their totals, and each round's); the model drafting
   for itself (acceptance ~100%: shows what drafting costs); a smaller draft (the bundled
   model's first DRAFT_LAYERS layers, cut from its GGUF: same vocabulary, a fraction of the
   weights). Output tokens/s of each and its ratio to no speculation; acceptance from the
   control plane's counters (mean acceptance length = tokens emitted per verification).
   Greedy outputs are the same in every configuration (the e2e tests check it; this
   asserts equal token counts).
2. Cross-over: the same prompts at 1..32 concurrent requests with n-gram speculation in
   every step vs none, to show where verifying proposals stops paying (the default
   --speculative-max-batch sits below it).
3. 32 concurrent requests with the default configuration (n-gram, adaptive, max batch):
   throughput vs none.
Run it alone on the machine: a second busy process changes the figures. The report is
written after each of 1, 2 and 3: a run stopped or failing part way keeps those it
measured (`unfinished`: those not measured; `failed`: the one that raised).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx

from benchmarks.online import launched
from benchmarks.workload import ReportParts, machine
from hetero_common.model_path import ModelNotFoundError, resolve_model_path
from hetero_proto import control_pb2 as pb
from hetero_proto import control_pb2_grpc as pb_grpc

K = 4
DRAFT_LAYERS = 8
MAX_TOKENS = 128
ROUNDS = 3  # alternated off / n-gram passes at batch 1
DEFAULT_AT_MAX_TOKENS = 96  # each request's, in the comparison with the defaults

CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def adults(users):
    return [u for u in users if u["age"] >= 18]
"""
CODE2 = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def is_empty(self):
        return len(self.items) == 0
"""
TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Members "
    "may borrow up to five books at a time for three weeks. Late returns cost ten cents "
    "per day per book. The reading room on the second floor is quiet and has free wifi, "
    "and the children's corner on the ground floor has story time every Saturday at ten."
)
TEXT2 = (
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the "
    "dough for ten minutes until it is smooth, then leave it to rise for an hour. Shape "
    "the loaf, let it rise for another thirty minutes, and bake it at two hundred degrees "
    "for forty minutes until the crust is golden brown."
)
TYPOS = (
    "Our team meeting is on Monday at ten in the morning. Please bring your laptop, the "
    "project plan and the budjet report. We will discus the new schedule, the design "
    "changes and the testing plan, and we will finish by noon."
)
# Tasks whose answers repeat their input: repeat, edit code, correct, extract.
PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Repeat the following text exactly, word for word:\n\n{TEXT2}",
    f"Add a docstring to each function in this code and write out the whole code:\n\n{CODE}",
    f"Add a docstring to each method in this code and write out the whole code:\n\n{CODE2}",
    f"Correct the spelling mistakes in this text and write out the corrected text:\n\n{TYPOS}",
    f"Extract the class from this code and write it out:\n\n{CODE2}",
]


def make_layer_draft(src: Path, num_layers: int, out: Path) -> Path:
    """A GGUF of `src`'s first `num_layers` layers (its embeddings, final norm, output and
    tokenizer kept, the quantized tensors copied as they are): a draft with its vocabulary."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = num_layers if key == f"{arch}.block_count" else f.contents()
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


async def _round(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """All `prompts` at once: (seconds, output tokens)."""
    seconds, tokens, _ = await _streamed(url, model, prompts, max_tokens)
    return seconds, tokens


async def _streamed(
    url: str, model: str, prompts: list[str], max_tokens: int
) -> tuple[float, int, float]:
    """All `prompts` at once, streamed: (seconds, output tokens, seconds after each
    request's first token, summed: the decode time)."""

    async def one(http: httpx.AsyncClient, text: str) -> tuple[int, float]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        first, tokens = None, 0
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if (
                    first is None
                    and chunk["choices"]
                    and chunk["choices"][0]["delta"].get("content")
                ):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        return tokens, time.perf_counter() - (first or time.perf_counter())

    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=64)) as http:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(http, p) for p in prompts))
        return time.perf_counter() - t0, sum(n for n, _ in got), sum(d for _, d in got)


def _spec_stats(control: str) -> dict[str, Any]:
    with grpc.insecure_channel(control) as ch:
        st = pb_grpc.ControlPlaneStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10).stats
    drafts = st.num_spec_drafts
    return {
        "verifications": drafts,
        "proposed_tokens": st.num_spec_draft_tokens,
        "accepted_tokens": st.num_spec_accepted_tokens,
        "acceptance_rate": round(st.num_spec_accepted_tokens / st.num_spec_draft_tokens, 3)
        if st.num_spec_draft_tokens
        else None,
        # tokens a verifying request emits per step (accepted + the sampled one)
        "mean_acceptance_length": round(1 + st.num_spec_accepted_tokens / drafts, 3)
        if drafts
        else None,
    }


def _stack(model: str, control: tuple[str, ...] = (), compute: tuple[str, ...] = ()) -> Any:
    return launched(
        model,
        control_args=("--no-enable-prefix-caching", *control),
        compute_args=("--kv-cache-bytes", str(256 << 20), *compute),
    )


@contextlib.contextmanager
def _stacks(
    model: str, configs: Sequence[tuple[str, tuple[str, ...], tuple[str, ...]]]
) -> Iterator[dict[str, tuple[str, str, str]]]:
    """The configurations' stacks up at once, so that their measurements can interleave
    (drift on the machine hits each alike): name -> (gateway URL, control address, served
    model)."""
    with contextlib.ExitStack() as stack:
        out = {}
        for name, control, compute in configs:
            url, address = stack.enter_context(_stack(model, control, compute))
            served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            asyncio.run(_round(url, served, ["Say hello."], 8))  # warm-up
            out[name] = (url, address, served)
        yield out


def _pass(url: str, served: str, prompts: list[str]) -> tuple[float, int, float]:
    """The prompts one at a time (batch 1): seconds, output tokens, decode seconds."""
    seconds, tokens, decode = 0.0, 0, 0.0
    for p in prompts:
        s, n, d = asyncio.run(_streamed(url, served, [p], MAX_TOKENS))
        seconds, tokens, decode = seconds + s, tokens + n, decode + d
    return seconds, tokens, decode


def _row(name: str, seconds: float, tokens: int, decode: float, n: int) -> dict[str, Any]:
    return {
        "config": name,
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "output_tok_s": round(tokens / seconds, 1),
        # After each first token (no prompt): tokens per second of decoding.
        "decode_tok_s": round((tokens - n) / decode, 1),
        # Until each first token (prompt, queueing, the hops), summed: what speculation
        # cannot shorten.
        "first_token_seconds": round(seconds - decode, 2),
    }


def batch_one(model: str, draft: Path, quick: bool) -> list[dict[str, Any]]:
    spec = ("--num-speculative-tokens", str(K))
    prompts = PROMPTS[:2] if quick else PROMPTS
    rounds = 1 if quick else ROUNDS
    rows: list[dict[str, Any]] = []
    # No speculation vs n-gram (the target): both stacks up, alternated over rounds in
    # turn-about order, one busy at a time (a second's pause between): the machine's
    # drift, which moved one-after-the-other runs by 10-20 %, hits both alike.
    pair: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
        ("off", (), ()),
        ("ngram", ("--speculative", "ngram", *spec), ()),
    ]
    totals: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name, _, _ in pair}
    per_round: list[float] = []
    with _stacks(model, pair) as stacks:
        for name in stacks:  # an untimed pass each
            _pass(stacks[name][0], stacks[name][2], prompts)
        for i_round in range(rounds):
            rate: dict[str, float] = {}
            for name in list(stacks)[:: 1 if i_round % 2 == 0 else -1]:
                time.sleep(1.0)
                url, _, served = stacks[name]
                seconds, tokens, decode = _pass(url, served, prompts)
                for i, v in enumerate((seconds, tokens, decode)):
                    totals[name][i] += v
                rate[name] = tokens / seconds
            per_round.append(round(rate["ngram"] / rate["off"], 3))
            print(f"batch 1, round {i_round + 1}: {rate} -> {per_round[-1]}x", flush=True)
        ngram_stats = _spec_stats(stacks["ngram"][1])
    for name, _, _ in pair:
        t_seconds, t_tokens, t_decode = totals[name]
        row = _row(name, t_seconds, int(t_tokens), t_decode, len(prompts) * rounds)
        if name == "ngram":
            row.update(ngram_stats)  # (every pass)
            row["speedup_per_round"] = per_round
        rows.append(row)
    # Draft-model configurations (no target): one stack at a time, an untimed pass and a
    # timed one.
    drafts: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
        ("draft_self", ("--speculative", "draft", *spec), ("--draft-model", model)),
        (
            f"draft_{DRAFT_LAYERS}_layers",
            ("--speculative", "draft", *spec),
            ("--draft-model", str(draft)),
        ),
    ]
    for config in drafts:
        with _stacks(model, [config]) as stacks:
            name = config[0]
            url, address, served = stacks[name]
            _pass(url, served, prompts)
            d_seconds, d_tokens, d_decode = _pass(url, served, prompts)
            stats = _spec_stats(address)
        row = _row(name, d_seconds, d_tokens, d_decode, len(prompts))
        row.update(stats)
        rows.append(row)
        print(f"batch 1, {name}: {row}", flush=True)
    base = rows[0]
    for r in rows:
        r["speedup"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
        r["decode_speedup"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
        per_pass = r["output_tokens"] // (rounds if r["config"] in totals else 1)
        assert per_pass == base["output_tokens"] // rounds, "greedy outputs changed length"
    return rows


def _compare(
    stacks: dict[str, tuple[str, str, str]], n: int, max_tokens: int, repeats: int
) -> dict[str, float]:
    """n concurrent requests on each stack in turn, `repeats` times, the order reversed
    every other time (the machine drifts within a minute): median tokens/s."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    runs: dict[str, list[float]] = {name: [] for name in stacks}
    for i in range(repeats):
        order = list(stacks.items())
        for name, (url, _, served) in order[:: -1 if i % 2 else 1]:
            time.sleep(1.0)  # the other stack's threads settle
            s, tokens = asyncio.run(_round(url, served, prompts, max_tokens))
            runs[name].append(tokens / s)
    return {name: round(statistics.median(r), 1) for name, r in runs.items()}


def concurrency(model: str, quick: bool) -> dict[str, Any]:
    """Where speculating in every step stops paying: n-gram forced on vs off."""
    levels = [1, 4, 8] if quick else [1, 2, 4, 8, 16, 32]
    max_tokens = 64 if quick else 96
    forced: tuple[str, ...] = ("--speculative", "ngram", "--num-speculative-tokens", str(K))
    forced += ("--speculative-max-batch", "256")
    configs = [("off", (), ()), ("ngram_every_step", forced, ())]
    out: dict[str, Any] = {
        "levels": levels,
        "max_tokens": max_tokens,
        "off": [],
        "ngram_every_step": [],
    }
    with _stacks(model, configs) as stacks:
        for c in levels:
            rates = _compare(stacks, c, max_tokens, 1 if quick else 2)
            for name, rate in rates.items():
                out[name].append(rate)
            print(f"{c} concurrent: {rates}", flush=True)
    out["ratio"] = [
        round(a / b, 3) for a, b in zip(out["ngram_every_step"], out["off"], strict=True)
    ]
    return out


def default_at(model: str, n: int, quick: bool) -> dict[str, Any]:
    """n concurrent requests with the default speculative configuration vs none."""
    configs = [("off", (), ()), ("ngram_default", ("--speculative", "ngram"), ())]
    with _stacks(model, configs) as stacks:
        rates = _compare(stacks, n, DEFAULT_AT_MAX_TOKENS, 1 if quick else 6)
    print(f"{n} concurrent: {rates}", flush=True)
    ratio = round(rates["ngram_default"] / rates["off"], 3)
    return {"concurrent": n, "max_tokens": DEFAULT_AT_MAX_TOKENS, **rates, "ratio": ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="default", help="a .gguf or a name ('default': the bundled GGUF)"
    )
    ap.add_argument("--out", type=Path, default=Path("docs/perf/speculative.json"))
    ap.add_argument("--quick", action="store_true", help="fewer prompts and levels (a smoke run)")
    args = ap.parse_args(argv)
    try:  # (a name, as the planes take it: the draft is cut from the file)
        model = str(resolve_model_path(args.model))
    except ModelNotFoundError as e:
        ap.error(f"--model: {e}")
    if not model.endswith(".gguf"):
        ap.error(f"--model: the draft is cut from a GGUF file, and {model} is not one")
    report: dict[str, Any] = {
        "machine": machine(),
        "model": Path(model).name,
        "k": K,
        "max_tokens": MAX_TOKENS,
    }
    parts = ReportParts(args.out, report, ["batch_1", "concurrency", "default_at_32"])
    tmp = Path(tempfile.mkdtemp(prefix="hetero-draft-"))
    draft = make_layer_draft(Path(model), DRAFT_LAYERS, tmp / f"first-{DRAFT_LAYERS}-layers.gguf")
    try:
        with parts.part("batch_1"):
            report["batch_1"] = batch_one(model, draft, args.quick)
        with parts.part("concurrency"):
            report["concurrency"] = concurrency(model, args.quick)
        with parts.part("default_at_32"):
            report["default_at_32"] = default_at(model, 8 if args.quick else 32, args.quick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for r in report["batch_1"]:
        extra = f", acceptance length {r['mean_acceptance_length']}" if "verifications" in r else ""
        print(
            f"batch 1 {r['config']}: {r['output_tok_s']} tok/s ({r['speedup']}x), decoding "
            f"{r['decode_tok_s']} tok/s ({r['decode_speedup']}x){extra}"
        )
    at = report["default_at_32"]
    print(f"{at['concurrent']} concurrent, default n-gram: {at['ratio']}x of none")
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
