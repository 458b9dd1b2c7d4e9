"""What structured output costs the control plane in memory and at its first request.

    python -m benchmarks.grammar_memory        # writes docs/perf/grammar_memory.json

Matchers: each spec is compiled once with llguidance and the bytes malloc holds after it
(glibc's mallinfo2: in use + mmapped, after a gc) less those before are its size;
llguidance exposes no size of its own. The figures set `--grammar-cache-mb`'s estimate
(control_plane/grammar.py `matcher_bytes`): the report gives each spec's size beside the
estimate. The vocabulary view: the seconds and bytes of building llguidance's view of
each tokenizer, and how long a 1 ms ticker on the event loop waits at most meanwhile
when it is built off the loop at the first constrained request (--no-grammar-warmup):
that is the stall of every other stream. Gemma 3 only where its packages are installed.
Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.json_schemas import SCHEMAS
from benchmarks.workload import machine, write_report
from control_plane import grammar
from control_plane.tokenizer import TokenizerWrapper, load_tokenizer
from hetero_common.model_path import ModelNotFoundError, bundled_gguf, gemma3_gguf
from hetero_proto import control_pb2 as pb


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def _malloced() -> int:
    gc.collect()
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _object(n: int, kind: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"field_{i}": {"type": kind} for i in range(n)},
        "required": [f"field_{i}" for i in range(n)],
        "additionalProperties": False,
    }


def _nested(n: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for i in range(n):
        s = {"type": "object", "properties": {f"k{i}": s, f"n{i}": {"type": "integer"}}}
    return s


def specs() -> list[tuple[str, pb.StructuredOutput]]:
    out = [(what, pb.StructuredOutput(json_schema=json.dumps(s))) for what, s in SCHEMAS]
    for n in (10, 100, 1000, 3000):
        out.append(
            (
                f"{n} string fields",
                pb.StructuredOutput(json_schema=json.dumps(_object(n, "string"))),
            )
        )
    out.append(
        (
            "1000 integer fields",
            pb.StructuredOutput(json_schema=json.dumps(_object(1000, "integer"))),
        )
    )
    for n in (5, 30, 60):
        out.append((f"nested {n}", pb.StructuredOutput(json_schema=json.dumps(_nested(n)))))
    for n in (100, 1000, 10000):
        enum = {"enum": [f"value number {i}" for i in range(n)]}
        out.append((f"enum of {n}", pb.StructuredOutput(json_schema=json.dumps(enum))))
    for n in (10, 1000, 10000, 100000):
        regex = "(" + "|".join(f"w{i}x" for i in range(n)) + ")"
        out.append((f"{n}-way regex", pb.StructuredOutput(regex=regex)))
    for n in (10, 1000, 10000):
        choice = pb.ChoiceList(choices=[f"option {i}" for i in range(n)])
        out.append((f"choice of {n}", pb.StructuredOutput(choice=choice)))
    out.append(("regex [a-z]{1,1000}", pb.StructuredOutput(regex="[a-z]{1,1000}")))
    out.append(("regex date", pb.StructuredOutput(regex=r"\d{4}-\d{2}-\d{2}")))
    rules = "\n".join(f'r{i}: "x{i}" r{i + 1} | "y{i}"' for i in range(200))
    out.append(("lark, 200 rules", pb.StructuredOutput(grammar=f'start: r0\n{rules}\nr200: "end"')))
    out.append(("json_object", pb.StructuredOutput(json_object=True)))
    return out


def matchers(tok: TokenizerWrapper) -> list[dict[str, Any]]:
    lltok = grammar.llguidance_view(tok)
    rows, kept = [], []
    for what, spec in specs():
        before = _malloced()
        kept.append(grammar._build(spec, lltok))
        size = _malloced() - before
        key = grammar.spec_key(spec)
        estimate = grammar.matcher_bytes(key)
        rows.append(
            {
                "spec": what,
                "spec_bytes": len(key),
                "matcher_bytes": size,
                "estimate_bytes": estimate,
                "estimate_over_measured": round(estimate / size, 2),
            }
        )
    return rows


async def _first_request_stall(tok: TokenizerWrapper) -> dict[str, float]:
    """The event loop's longest wait while the first grammar compiles on a Grammars that
    was not warmed (its view built off the loop, as --no-grammar-warmup does)."""
    grammars = grammar.Grammars(tok)
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    await grammars.prepare(pb.StructuredOutput(json_object=True))
    seconds = time.perf_counter() - t0
    done = True
    await ticker
    return {
        "first_prepare_s": round(seconds, 3),
        "longest_loop_gap_s": round(max(gaps), 3),
        "loop_gaps_over_20ms_s": round(sum(g for g in gaps if g > 0.02), 3),
    }


def view(tok: TokenizerWrapper) -> dict[str, Any]:
    stall = asyncio.run(_first_request_stall(tok))  # (builds the shared view: first)
    grammar._views.pop(tok, None)
    before = _malloced()
    t0 = time.perf_counter()
    grammar.llguidance_view(tok)
    seconds = time.perf_counter() - t0
    return {
        "vocab_size": tok.vocab_size,
        "build_s": round(seconds, 3),
        "bytes": _malloced() - before,
        "lazy_first_request": stall,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/perf/grammar_memory.json"))
    args = ap.parse_args(argv)
    models = {"smollm2": bundled_gguf()}
    with contextlib.suppress(ModelNotFoundError):  # (its packages are not installed)
        models["gemma3"] = gemma3_gguf()
    report: dict[str, Any] = {"machine": machine(), "views": {}}
    for name, path in models.items():
        tok = load_tokenizer(path)
        report["views"][name] = view(tok)
        if name == "smollm2":
            report["matchers"] = matchers(tok)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
