#!/usr/bin/env bash
# Run HERE (the CPU machine, which reaches the package registry), in the repository root:
# downloads into .whl/ (git-ignored) the wheels the lent GPU machine's image lacks for our
# planes and benchmarks, at the versions installed here, for its Python 3.12. Then a
# device call carries `.whl` and runs benchmarks/device/check.sh (see its header).
set -euo pipefail
cd "$(dirname "$0")/../.."
version() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
mkdir -p .whl
for name in grpcio grpcio-health-checking grpcio-reflection protobuf gguf llguidance jsonschema-rs \
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d .whl \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 \
    "$name==$(version "$name")"
done
du -sh .whl
