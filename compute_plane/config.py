"""The compute plane's one config dataclass (CLI flags are generated from its fields)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hetero_common.server_config import GrpcServerConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "cpu", "torch", "triton")


@dataclass(frozen=True)
class ComputeConfig(GrpcServerConfig):
    model: str = field(
        default="default",
        metadata={
            "help": "HF folder, .gguf file, 'default' (bundled SmolLM2-135M-Instruct) or 'gemma3' (Gemma 3 270M)"
        },
    )
    port: int = field(default=50052, metadata={"help": "gRPC port"})
    device: str = field(
        default="auto",
        metadata={"help": "auto (cuda if torch sees a GPU, else cpu), cuda[:N], cpu"},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": f"weights and KV cache dtype: {', '.join(_DTYPES)} "
            "(auto: float32 on CPU, bfloat16 on CUDA)"
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto (triton on CUDA; on CPU the C kernel for float32, else torch), "
            "cpu (C decode kernel, float32), torch, triton "
            "(on CPU only under TRITON_INTERPRET=1, for tests)"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "CPU: bytes for the KV cache (decides the block count)"}
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "CUDA: fraction of the GPU's memory this process may use (sizes the KV pool)"
        },
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={
            "help": "CUDA: most tokens in one step (sizes the profiling forward; larger steps are refused)"
        },
    )
    max_num_seqs: int = field(
        default=256, metadata={"help": "CUDA: most requests in one step (largest CUDA graph)"}
    )
    cuda_graphs: bool = field(
        default=True,
        metadata={"help": "CUDA: replay decode steps from CUDA graphs captured at start-up"},
    )
    piecewise_graphs: int = field(
        default=512,
        metadata={
            "help": "CUDA, Triton path: other steps (prefill chunks, mixed prefill and "
            "decode) of at most this many tokens replay CUDA graphs captured at start-up "
            "between their attentions, which run eagerly (0: off; needs --cuda-graphs)"
        },
    )
    fused_linear: str = field(
        default="auto",
        metadata={
            "help": "Triton path: steps of at most 16 tokens run a layer's norms and SiLU "
            "inside its projections' kernels (fewer launches for small batches): auto (on "
            "CUDA, up to the row count where a timing at start-up finds them faster), on "
            "(always), off"
        },
    )
    pdl: str = field(
        default="auto",
        metadata={
            "help": "CUDA, Triton path: launch the decode step's Triton kernels as programmatic "
            "dependent launches, each starting while the one before finishes (fewer idle "
            "microseconds between a small step's ~200 launches): auto (on a Hopper or later "
            "GPU), on (such a GPU required), off"
        },
    )
    overlap_steps: str = field(
        default="auto",
        metadata={
            "help": "launch a step before the last one's samples reach the host, so the "
            "host prepares step k+1 while the device computes step k: auto (on on CUDA, "
            "where the device runs behind the host), on, off"
        },
    )
    engine_thread: str = field(
        default="auto",
        metadata={
            "help": "make every engine call on a worker thread (on), or launch and finish "
            "steps of decodes only on the server's event loop (off): auto (on for a CPU, "
            "where a launch computes the forward; off on CUDA, where a decode step's launch "
            "only queues device work and the hop to a worker and back costs host time the "
            "GPU waits for)"
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "cap on prompt + output tokens (default: the model's context length)"},
    )
    metrics_port: int = field(
        default=8002,
        metadata={
            "help": "port of the Prometheus /metrics endpoint (0: a free one, logged; -1: off)"
        },
    )
    quantization: str = field(
        default="auto",
        metadata={
            "help": "auto: a quantized GGUF's weights stay quantized on the CPU in float32 "
            "(dequantized on CUDA), an FP8 checkpoint stays FP8 on GPUs with FP8 matmuls "
            "(compute capability 8.9+; INT8 on others); none: dequantize every weight; "
            "int8: quantize dense weights to int8 too (CPU float32: per group of 32, the C "
            "kernels; elsewhere weight-only per output channel); fp8: quantize the layers' "
            "matrices to FP8 e4m3 per output channel, activations per token (torch._scaled_mm)"
        },
    )
    cpu_activations: str = field(
        default="int16",
        metadata={
            "help": "how decode steps multiply activations by quantized weights on the CPU: "
            "int16 (rounded per group of 32 to 2^-16 of its largest value, integer "
            "multiply-adds; faster) or fp32 (exact: the dequantized weights' result)"
        },
    )
    draft_model: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding: a smaller model with the target's vocabulary (HF "
            "folder, .gguf, or 'default') that drafts tokens when a step asks for them; "
            "its KV cache takes a share of the KV memory"
        },
    )
    max_speculative_tokens: int = field(
        default=16,
        metadata={"help": "speculative decoding: most proposed tokens a request verifies a step"},
    )
    num_threads: int | None = field(
        default=None,
        metadata={
            "help": "worker threads of every kernel (default: the CPUs this process may use: "
            "its affinity, capped by its cgroup CPU quota)"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantization not in ("auto", "none", "int8", "fp8"):
            raise ValueError(
                f"quantization must be auto, none, int8 or fp8, got {self.quantization!r}"
            )
        for name in ("fused_linear", "pdl", "overlap_steps", "engine_thread"):
            if (value := getattr(self, name)) not in ("auto", "on", "off"):
                raise ValueError(f"{name} must be auto, on or off, got {value!r}")
        if self.cpu_activations not in ("int16", "fp32"):
            raise ValueError(f"cpu_activations must be int16 or fp32, got {self.cpu_activations!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(
                "max_num_batched_tokens and max_num_seqs must be >= 1, got "
                f"{self.max_num_batched_tokens} and {self.max_num_seqs}"
            )
        if self.piecewise_graphs < 0:
            raise ValueError(f"piecewise_graphs must be >= 0, got {self.piecewise_graphs}")
        if not 0 <= self.max_speculative_tokens <= 64:
            raise ValueError(
                f"max_speculative_tokens must be in 0..64, got {self.max_speculative_tokens}"
            )
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in 1..256, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
