"""`hetero-infer` command line: one subcommand per process, plus local conveniences."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from hetero_infer.config_cli import add_dataclass_arguments, config_from_args


def _compute_plane(args: argparse.Namespace) -> int:
    from compute_plane.config import ComputeConfig
    from compute_plane.server import serve

    asyncio.run(serve(config_from_args(ComputeConfig, args)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from compute_plane.config import ComputeConfig

    parser = argparse.ArgumentParser(prog="hetero-infer", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compute-plane", help="serve the model over compute.proto (gRPC)")
    add_dataclass_arguments(p, ComputeConfig)
    p.set_defaults(func=_compute_plane)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        # Bad configuration or a missing model: one clear line, no traceback.
        print(f"hetero-infer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
