"""The compute plane's one config dataclass (CLI flags are generated from its fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero_infer.tls import ServerTLS

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ComputeConfig:
    model: str = field(
        default="default",
        metadata={"help": "HF folder, .gguf file, or 'default' (bundled SmolLM2-135M-Instruct)"},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind the gRPC server to"})
    port: int = field(default=50052, metadata={"help": "gRPC port"})
    device: str = field(default="cpu", metadata={"help": "cpu (CUDA arrives with the GPU backend)"})
    dtype: str = field(
        default="float32", metadata={"help": f"weights and KV cache dtype: {', '.join(_DTYPES)}"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "CPU: bytes for the KV cache (decides the block count)"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "cap on prompt + output tokens (default: the model's context length)"},
    )
    metrics_port: int = field(
        default=8002, metadata={"help": "port of the Prometheus /metrics endpoint (0 = off)"}
    )
    num_threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (default: torch's choice)"}
    )
    drain_timeout: float = field(
        default=30.0,
        metadata={"help": "on SIGTERM: seconds to finish in-flight requests before exiting"},
    )
    tls_cert: str | None = field(
        default=None, metadata={"help": "PEM certificate: serve gRPC over TLS (with --tls-key)"}
    )
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str | None = field(
        default=None,
        metadata={"help": "PEM CA bundle: require client certificates signed by it (mutual TLS)"},
    )

    @property
    def tls(self) -> ServerTLS:
        return ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca)

    def __post_init__(self) -> None:
        self.tls  # noqa: B018 -- validates the TLS flags
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device != "cpu":
            raise ValueError(
                f"device must be 'cpu' (got {self.device!r}); the CUDA backend is not built yet"
            )
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in 1..256, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
