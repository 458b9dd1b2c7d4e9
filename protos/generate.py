"""Generate the Python protobuf / gRPC stubs from protos/hetero_proto/*.proto.

    python protos/generate.py            # writes hetero_proto/*_pb2*.py(i) at the repo root
    python protos/generate.py --out DIR  # writes into DIR/hetero_proto (used by the staleness test)

Generated code stays generated: never edit hetero_proto/*_pb2*.py by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = sorted((PROTO_ROOT / "hetero_proto").glob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc  # imported late: only a dev/test dependency

    (out / "hetero_proto").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
