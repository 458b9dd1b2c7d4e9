"""`hetero-infer`'s subcommands (one per process, plus local conveniences) and their
parser; `hetero_infer.cli` is the entry point that imports this."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from hetero_common.limits import MAX_TEMPERATURE
from hetero_common.logs import LOG_FORMATS, setup_logging
from hetero_common.tracing import setup_tracing
from hetero_infer.config_cli import add_dataclass_arguments, config_from_args
from hetero_infer.local import PlaneExited, PortUnavailable, die_with_parent


def _compute_plane(args: argparse.Namespace) -> int:
    from compute_plane import threads
    from compute_plane.config import ComputeConfig

    config = config_from_args(ComputeConfig, args)
    threads.configure(config.num_threads)  # before torch loads libgomp
    from compute_plane.server import serve

    asyncio.run(serve(config))
    return 0


def _no_compute_plane(args: argparse.Namespace) -> int:
    raise ValueError(
        "this installation has no compute plane (the planes image); use a compute image"
    )


def _control_plane(args: argparse.Namespace) -> int:
    from control_plane.config import ControlConfig
    from control_plane.server import serve

    asyncio.run(serve(config_from_args(ControlConfig, args)))
    return 0


def _generate(args: argparse.Namespace) -> int:
    """Start both planes locally, stream one completion to stdout, stop them."""
    import grpc

    from hetero_infer.local import local_planes
    from hetero_proto import control_pb2 as pb
    from hetero_proto import control_pb2_grpc as pb_grpc

    params = pb.GenerationParams(
        max_tokens=args.max_tokens, temperature=args.temperature, skip_special_tokens=True
    )
    if args.seed is not None:
        params.seed = args.seed
    request = pb.GenerateRequest(params=params)
    if args.chat:
        request.chat.messages.add(role="user", content=args.prompt)
        request.chat.add_generation_prompt = True
    else:
        request.text = args.prompt
    with (
        local_planes(args.model, quiet=not args.verbose) as control,
        grpc.insecure_channel(control) as ch,
    ):
        try:
            for resp in pb_grpc.ControlPlaneStub(ch).Generate(request):
                for choice in resp.choices:
                    sys.stdout.write(choice.text)
                    sys.stdout.flush()
        except grpc.RpcError as e:  # the control plane's own message, not a traceback
            print(f"hetero-infer: error: {e.details()}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    sys.stdout.write("\n")
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from gateway.app import serve
    from gateway.config import GatewayConfig

    asyncio.run(serve(config_from_args(GatewayConfig, args)))
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Compute plane, control plane and gateway as three processes on loopback."""
    from hetero_infer.local import check_ports, serve_stack

    log_args: tuple[str, ...] = ("--log-level", args.log_level, "--log-format", args.log_format)
    if args.otlp_traces_endpoint:
        log_args += ("--otlp-traces-endpoint", args.otlp_traces_endpoint)
    control_args: list[str] = list(args.control_arg or [])
    compute_args: list[str] = list(args.compute_arg or [])
    if args.chat_template:
        control_args += ["--chat-template", args.chat_template]
    gateway_args: tuple[str, ...] = ()
    if args.served_model_name is not None:  # every plane's: the metrics' label, the API's id
        name = ["--served-model-name", args.served_model_name]
        control_args += name
        compute_args += name
        gateway_args += tuple(name)
    # Checked before the planes start, not once they have loaded, naming serve's flags (a
    # plane named its own: --metrics-port, or --max-speculative-tokens for a bad k).
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    for plane, port in (
        ("compute", args.compute_metrics_port),
        ("control", args.control_metrics_port),
    ):
        if not -1 <= port < 65536:
            raise ValueError(f"--{plane}-metrics-port must be in -1..65535, got {port}")
    _check_metrics_ports(
        args.port, args.compute_metrics_port, args.control_metrics_port, args.compute_planes
    )
    method = args.speculative or ("draft" if args.draft_model else None)
    if method is not None and not 1 <= args.num_speculative_tokens <= 64:
        raise ValueError(
            f"--num-speculative-tokens must be in 1..64, got {args.num_speculative_tokens}"
        )
    if method == "draft" and not args.draft_model:
        raise ValueError("--speculative draft needs --draft-model PATH")
    if method == "ngram" and args.draft_model:
        raise ValueError("--draft-model is for --speculative draft")
    if method is not None:
        k = str(args.num_speculative_tokens)
        control_args += ["--speculative", method, "--num-speculative-tokens", k]
        compute_args += ["--max-speculative-tokens", k]
    if args.draft_model:
        compute_args += ["--draft-model", args.draft_model]
    _check_memory(args.model, args.compute_planes, compute_args)
    check_ports([("--port", args.host, args.port)])  # (the metrics ports: above)
    return serve_stack(
        args.model,
        args.host,
        args.port,
        compute_args,
        log_args=log_args,
        metrics_ports=(args.compute_metrics_port, args.control_metrics_port),
        control_args=tuple(control_args),
        num_compute=args.compute_planes,
        gateway_args=gateway_args,
    )


def _check_metrics_ports(port: int, compute: int, control: int, planes: int) -> None:
    """serve's /metrics ports given: compute plane i's is --compute-metrics-port + i. Each
    must be a port, no other port of the stack, and free (a plane that could not bind its
    own stopped the stack once the others had loaded, naming its --metrics-port)."""
    from hetero_common.cpus import usable_cpus
    from hetero_infer.local import compute_metrics_ports, listener

    if not 1 <= planes <= usable_cpus():
        return  # (local_planes names --compute-planes)
    ports = {"--port": port}
    for i, p in enumerate(compute_metrics_ports(compute, planes)):
        if p > 0:
            name = f"--compute-metrics-port + {i} (compute plane {i + 1}'s)" if i else ""
            ports[name or "--compute-metrics-port"] = p
    if control > 0:
        ports["--control-metrics-port"] = control
    if compute > 0 and compute + planes - 1 > 65535:
        raise ValueError(
            f"--compute-metrics-port {compute}: the {planes} compute planes take ports "
            f"{compute}..{compute + planes - 1}, past 65535"
        )
    seen: dict[int, str] = {}
    for name, p in ports.items():
        if p in seen:
            raise ValueError(f"{name} is port {p}, as {seen[p]} is")
        seen[p] = name
        if name == "--port":
            continue  # (the gateway's, on --host: check_ports tries it)
        try:
            listener("127.0.0.1", p).close()  # (the planes' metrics listen on loopback)
        except OSError as e:
            raise ValueError(f"{name}: port {p} is not free ({e.strerror or e})") from None


def _check_memory(model: str, planes: int, compute_args: list[str]) -> None:
    """serve's CPU compute planes, before any starts: their weights and KV caches must fit
    the memory together (each plane checks its own before loading, when the others' pools,
    mapped lazily, hold nothing yet and their weights may not be in yet: the OOM killer
    came later, as they loaded or the caches filled; and a refusal named here comes before
    any process starts). The weights: host_memory.weights_estimate."""
    from compute_plane.config import ComputeConfig
    from compute_plane.host_memory import check_kv_budget, weights_estimate

    config = config_from_args(
        ComputeConfig, build_parser().parse_args(["compute-plane", *compute_args])
    )
    if config.device.startswith("cuda"):
        return  # (sized from the GPU's free memory, not --kv-cache-bytes)
    try:
        check_kv_budget(config.kv_cache_bytes, planes, weights_estimate(model, config.draft_model))
    except ValueError:
        if config.device == "auto" and _cuda():  # (torch imported only here: seconds)
            return
        raise


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def build_parser() -> argparse.ArgumentParser:
    from control_plane.config import ControlConfig
    from gateway.config import GatewayConfig

    parser = argparse.ArgumentParser(
        prog="hetero-infer",
        description="`hetero-infer` command line: one subcommand per process, plus local "
        "conveniences.",
    )
    _add_process_flags(parser, defaults=True)
    # The same flags after the subcommand (`hetero-infer serve --log-format json`).
    common = argparse.ArgumentParser(add_help=False)
    _add_process_flags(common, defaults=False)
    sub = parser.add_subparsers(dest="command", required=True)
    add = functools.partial(sub.add_parser, parents=[common])

    p = add("compute-plane", help="serve the model over compute.proto (gRPC)")
    try:
        from compute_plane.config import ComputeConfig
    except ModuleNotFoundError:  # the planes image ships no compute plane
        p.set_defaults(func=_no_compute_plane)
    else:
        add_dataclass_arguments(p, ComputeConfig)
        p.set_defaults(func=_compute_plane)

    p = add("control-plane", help="serve control.proto, driving a compute plane")
    add_dataclass_arguments(p, ControlConfig)
    p.set_defaults(func=_control_plane)

    p = add("generate", help="run both planes locally and stream one completion")
    p.add_argument("prompt", type=_utf8)
    p.add_argument("--model", default="default", help="HF folder, .gguf, 'default' or 'gemma3'")
    p.add_argument(
        "--max-tokens", type=_int_in(0, 2**31 - 1), default=64, help="0 = up to the context"
    )
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=_int_in(0, 2**64 - 1), default=None)
    p.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    p.add_argument("--verbose", action="store_true", help="show the planes' logs")
    p.set_defaults(func=_generate)

    p = add("gateway", help="serve the OpenAI HTTP API in front of a control plane")
    add_dataclass_arguments(p, GatewayConfig)
    p.set_defaults(func=_gateway)

    p = add("serve", help="start compute plane, control plane and gateway locally")
    p.add_argument("--model", default="default", help="HF folder, .gguf, 'default' or 'gemma3'")
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP API")
    p.add_argument("--port", type=int, default=8000, help="port of the HTTP API")
    p.add_argument(
        "--served-model-name",
        type=_name,
        default=None,
        help="the model's name in the API (the `model` clients send) and in every plane's "
        "metrics (model_name); default: the model file's name",
    )
    p.add_argument(
        "--compute-planes",
        type=int,
        default=1,
        help="compute planes behind the control plane (data parallel; at most the CPUs "
        "this process may use, each gets an equal share of them unless --compute-arg sets "
        "--num-threads)",
    )
    for plane in ("compute", "control"):
        p.add_argument(
            f"--{plane}-metrics-port",
            type=int,
            default=0,
            help=f"port of the {plane} plane's /metrics (0: a free one, logged; -1: off)",
        )
    p.add_argument(
        "--chat-template", default=None, help="a jinja2 chat template file (overrides the model's)"
    )
    p.add_argument(
        "--speculative",
        choices=("ngram", "draft"),
        default=None,
        help="speculative decoding: ngram (prompt lookup) or draft (needs --draft-model)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="speculative decoding: most tokens proposed per step",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="speculative decoding: a smaller model with the same tokenizer (HF folder, "
        ".gguf, or 'default'), loaded by the compute plane beside the target",
    )
    p.add_argument(
        "--compute-arg",
        action="append",
        help="extra flag for the compute plane, e.g. --compute-arg=--kv-cache-bytes=268435456",
    )
    p.add_argument(
        "--control-arg",
        action="append",
        help="extra flag for the control plane, e.g. --control-arg=--speculative-max-batch=4",
    )
    p.set_defaults(func=_serve)
    return parser


def _add_process_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """Logs and traces; after a subcommand they override the ones before it."""
    level, fmt, otlp = ("INFO", "text", None) if defaults else (argparse.SUPPRESS,) * 3
    parser.add_argument(
        "--log-level",
        default=level,
        type=_log_level,
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL",
    )
    parser.add_argument(
        "--log-format",
        default=fmt,
        choices=LOG_FORMATS,
        help="text, or json: one JSON object per line with the request id (log collectors)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=otlp,
        metavar="URL",
        help="send OpenTelemetry traces (OTLP/gRPC) there, e.g. http://otel-collector:4317; "
        "needs the otel extra",
    )


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An int flag the request's field can hold (protobuf's 'Value out of range' named
    no flag)."""

    def parse(value: str) -> int:
        n = int(value)  # (a ValueError: argparse's "invalid ... value")
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {n}")
        return n

    parse.__name__ = "int"
    return parse


def _temperature(value: str) -> float:
    """A temperature the control plane takes (it refused others once both planes had
    loaded)."""
    t = float(value)  # (a ValueError: argparse's "invalid ... value")
    if not 0 <= t <= MAX_TEMPERATURE:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_TEMPERATURE:g}], got {value}")
    return t


def _utf8(value: str) -> str:
    """An argument the request can carry: bytes that are not UTF-8 reach Python as
    surrogates, which protobuf refused with a message that named no argument; an empty
    prompt, which the control plane refused once both planes had loaded."""
    if not value:
        raise argparse.ArgumentTypeError("is empty")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8") from None
    return value


def _name(value: str) -> str:
    """A served model name: not empty (each plane refused one once it had started)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty")
    return value


def _log_level(value: str) -> str:
    """A level logging knows, in any case (an unknown one was logging's ValueError
    traceback once the command ran, not a usage error)."""
    if value.upper() not in logging.getLevelNamesMapping():
        raise argparse.ArgumentTypeError(
            f"invalid level {value!r} (DEBUG, INFO, WARNING, ERROR or CRITICAL)"
        )
    return value.upper()


SERVERS = ("compute-plane", "control-plane", "gateway")


def run(argv: list[str] | None = None) -> int:
    """`hetero-infer ARGV` (default: sys.argv[1:]); its exit status (a plane's process, run
    from the command line, ends here: `exit_now`). Ctrl-C: `hetero_infer.cli.main`."""
    die_with_parent()  # a plane that serve or generate started ends with it
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        if args.command in SERVERS:
            setup_tracing(f"hetero-{args.command}", args.otlp_traces_endpoint)
        code = int(args.func(args))
        if args.command in SERVERS and argv is None:
            exit_now(code)  # a plane's process, not a caller's (tests call main(argv))
        return code
    except (ValueError, FileNotFoundError) as e:
        # Bad configuration or a missing model: one clear line, no traceback.
        print(f"hetero-infer: error: {e}", file=sys.stderr)
        return 2
    except (PlaneExited, TimeoutError, PortUnavailable) as e:  # a plane did not / cannot start
        print(f"hetero-infer: error: {e}", file=sys.stderr)
        return 1


def exit_now(code: int) -> NoReturn:
    """End a plane's process once it has shut down: the exit handlers run (the trace
    exporter's last flush, logging's), then the process ends without the interpreter's
    teardown of every module, which took a compute plane ~0.8 s after its last log line."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
