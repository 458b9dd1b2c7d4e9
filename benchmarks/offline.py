"""Offline throughput: the same workload through our engine and HF transformers, one run.

    python -m benchmarks.offline                   # default preset, writes docs/perf/offline.json
    python -m benchmarks.offline --preset gpu      # 256 requests, 100-1024 in and out

(a) ours in-process (hetero_infer.offline: scheduler + compute engine, no gRPC);
(b) HF `generate` with static batching (left-padded batches in arrival order, each run
    until its longest output; only the requested tokens count as useful);
(c) ours through all three processes (HTTP -> gateway -> gRPC -> control -> compute).
Greedy, EOS ignored, same model, same machine, one after the other; (a) and the gRPC
path (`run_grpc`) each run an untimed warm-up round first (`warmup_work`).

The report is written after each of (a), (b) and (c): a run stopped or failing part way
keeps the parts it measured (`unfinished`: those not measured; `failed`: the one that
raised).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.workload import PRESETS, ReportParts, Request, machine, make_workload, preset_dict
from hetero_common.model_path import resolve_model_path

if TYPE_CHECKING:
    from hetero_infer.offline import OfflineLLM


def warmup_work(work: list[Request], n: int = 16, output_len: int = 4) -> list[Request]:
    """The untimed round before a timed one: the workload's first `n` prompts, a few
    tokens each, all at once, so that its prefill, mixed and decode steps meet their
    shapes first (on a GPU, each Triton kernel compiles a variant per shape class: where
    the first process to meet one pays seconds, the next loads it from the disk cache)."""
    return [Request(r.prompt, min(output_len, r.output_len)) for r in work[:n]]


def run_ours(model: str | OfflineLLM, work: list[Request], warmup: int = 16) -> dict[str, Any]:
    """The workload through `OfflineLLM` (scheduler and engine in this process), after an
    untimed round of its first `warmup` prompts (`warmup_work`)."""
    from hetero_infer.offline import OfflineLLM
    from hetero_proto import control_pb2 as pb

    llm = OfflineLLM(model) if isinstance(model, str) else model

    def params(reqs: list[Request]) -> list[pb.GenerationParams]:
        return [
            pb.GenerationParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            for r in reqs
        ]

    warm = warmup_work(work, warmup)
    llm.generate([r.prompt for r in warm], params(warm))
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in work], params(work))
    elapsed = time.perf_counter() - start
    got = [len(o.token_ids[0]) for o in outs]
    assert got == [r.output_len for r in work], "every request must produce its tokens"
    return _figures("ours (in-process)", work, elapsed)


def run_hf(model: str, work: list[Request], batch_size: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    # As ours runs: fp32 on the CPU, bf16 on a GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    hf = hf.to(device)  # type: ignore[arg-type]
    hf.eval()
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i : i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding, as generate expects
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        new = max(r.output_len for r in batch)
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert isinstance(out, torch.Tensor)
        generated += (out.shape[1] - width) * len(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    fig = _figures(f"HF transformers generate, static batch {batch_size}", work, elapsed)
    fig["generated_tokens_incl_padding"] = generated
    return fig


def run_gateway(model: str, work: list[Request], concurrency: int) -> dict[str, Any]:
    import subprocess
    import sys

    import httpx

    from hetero_infer.local import free_port, local_planes, stop_process, wait_http_ready

    with local_planes(model) as control:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "hetero_infer.cli", "--log-level", "WARNING", "gateway"]
        gw = subprocess.Popen([*cmd, "--port", str(port), "--control", control])
        try:
            wait_http_ready(url + "/ready", gw)
            name = httpx.get(url + "/v1/models").json()["data"][0]["id"]

            async def main() -> tuple[float, list[int]]:
                limit = asyncio.Semaphore(concurrency)
                async with httpx.AsyncClient(base_url=url, timeout=3600) as http:

                    async def one(r: Request) -> int:
                        body = {"model": name, "prompt": r.prompt, "max_tokens": r.output_len}
                        body |= {"temperature": 0, "ignore_eos": True}
                        async with limit:
                            resp = await http.post("/v1/completions", json=body)
                        resp.raise_for_status()
                        return int(resp.json()["usage"]["completion_tokens"])

                    start = time.perf_counter()
                    counts = await asyncio.gather(*(one(r) for r in work))
                    return time.perf_counter() - start, list(counts)

            elapsed, counts = asyncio.run(main())
        finally:
            stop_process(gw)
    assert counts == [r.output_len for r in work], "every request must produce its tokens"
    return _figures("ours through gateway + gRPC (3 processes)", work, elapsed)


def run_grpc(
    model: str,
    work: list[Request],
    compute_args: tuple[str, ...] = (),
    control_args: tuple[str, ...] = (),
    num_compute: int = 1,
    quiet: bool = True,
    timeout: float | None = None,
    warmup: int = 16,
) -> dict[str, Any]:
    """The workload through the path users deploy: a compute plane and a control plane,
    each its own process, and this process calling the control plane's gRPC `Generate`
    for every request at once (token-id prompts, greedy, EOS ignored). No gateway: the
    figure is the two planes' and their gRPC hop's. `num_compute`: compute planes behind
    the control plane (data parallel). `quiet`: the planes' logs are dropped (else they
    go to this process's stdout and stderr). `timeout`: seconds from the call by which
    the planes must be serving and the workload finished (TimeoutError, the planes
    stopped). `warmup`: prompts of the untimed round before (`warmup_work`)."""
    import grpc

    from hetero_infer.local import local_planes
    from hetero_proto import control_pb2 as pb
    from hetero_proto import control_pb2_grpc as pb_grpc

    called = time.perf_counter()
    with local_planes(
        model,
        quiet=quiet,
        extra_compute=compute_args,
        extra_control=control_args,
        metrics_ports=(-1, -1),
        num_compute=num_compute,
        start_timeout=timeout,
    ) as control:

        async def main() -> tuple[float, list[int]]:
            async with grpc.aio.insecure_channel(
                control, options=[("grpc.max_receive_message_length", 64 << 20)]
            ) as ch:
                stub = pb_grpc.ControlPlaneStub(ch)

                async def one(r: Request) -> int:
                    params = pb.GenerationParams(max_tokens=r.output_len, ignore_eos=True)
                    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=r.prompt), params=params)
                    tokens = 0
                    async for resp in stub.Generate(req, timeout=3600):
                        tokens += sum(len(c.token_ids) for c in resp.choices)
                    return tokens

                async def all_of(reqs: list[Request]) -> list[int]:
                    left = None if timeout is None else timeout - (time.perf_counter() - called)
                    try:
                        return await asyncio.wait_for(asyncio.gather(*map(one, reqs)), left)
                    except TimeoutError:
                        msg = f"the workload did not finish within {timeout} s"
                        raise TimeoutError(msg) from None

                await all_of(warmup_work(work, warmup))  # untimed
                start = time.perf_counter()
                counts = await all_of(work)
                return time.perf_counter() - start, list(counts)

        elapsed, counts = asyncio.run(main())
    assert counts == [r.output_len for r in work], "every request must produce its tokens"
    name = "ours, compute + control plane processes over gRPC"
    if control_args or compute_args:
        name += ", " + " ".join((*control_args, *compute_args))
    return _figures(name, work, elapsed)


def _figures(name: str, work: list[Request], elapsed: float) -> dict[str, Any]:
    useful = sum(r.output_len for r in work)
    prompt = sum(len(r.prompt) for r in work)
    return {
        "system": name,
        "seconds": round(elapsed, 3),
        "useful_output_tokens": useful,
        "output_tokens_per_s": round(useful / elapsed, 2),
        "total_tokens_per_s": round((useful + prompt) / elapsed, 2),
        "requests_per_s": round(len(work) / elapsed, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-gateway", action="store_true")
    ap.add_argument("--concurrency", type=int, default=256, help="gateway run: requests in flight")
    ap.add_argument("--out", type=Path, default=Path("docs/perf/offline.json"))
    args = ap.parse_args(argv)
    work = make_workload(PRESETS[args.preset], args.seed)
    report: dict[str, Any] = {
        "benchmark": "offline",
        "preset": args.preset,
        "workload": preset_dict(PRESETS[args.preset]) | {"seed": args.seed},
        "machine": machine(),
        "runs": [],
    }
    skipped = {"ours": False, "hf": args.skip_hf, "gateway": args.skip_gateway}
    parts = ReportParts(args.out, report, [p for p, skip in skipped.items() if not skip])
    with parts.part("ours"):
        ours = run_ours(args.model, work)
        report["runs"].append(ours)
        print(json.dumps(ours))
    if not args.skip_hf:
        with parts.part("hf"):
            hf = run_hf(args.model, work, args.hf_batch_size)
            report["runs"].append(hf)
            ratio = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
            report["ours_vs_hf"] = round(ratio, 2)
            print(json.dumps(hf))
    if not args.skip_gateway:
        with parts.part("gateway"):
            gw = run_gateway(args.model, work, args.concurrency)
            report["runs"].append(gw)
            ratio = gw["output_tokens_per_s"] / ours["output_tokens_per_s"]
            report["gateway_vs_offline"] = round(ratio, 2)
            print(json.dumps(gw))
    report["machine"]["load_average_after"] = machine()["load_average"]
    parts.write()
    for key in ("ours_vs_hf", "gateway_vs_offline"):
        if key in report:
            print(f"{key}: {report[key]}x")
    print(f"report: {args.out}")
    return report


if __name__ == "__main__":
    main()
