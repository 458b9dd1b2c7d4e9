"""The fields every server process has (bind address, drain) and the gRPC planes' extras.

Each plane's config dataclass derives from one of these, so a flag means the same thing
and is checked the same way in every process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero_common.tls import ServerTLS


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind the server to"})
    port: int = field(default=0, metadata={"help": "port of the server"})
    drain_timeout: float = field(
        default=30.0,
        metadata={"help": "on SIGTERM: seconds to finish in-flight requests before exiting"},
    )

    def __post_init__(self) -> None:
        if not self.drain_timeout >= 0:  # NaN too (it drained nothing)
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")


@dataclass(frozen=True)
class GrpcServerConfig(ServerConfig):
    """A gRPC plane: Prometheus on its own port, optional (mutual) TLS."""

    metrics_port: int = field(
        default=-1,
        metadata={
            "help": "port of the Prometheus /metrics endpoint (0: a free one, logged; -1: off)"
        },
    )
    tls_cert: str | None = field(
        default=None, metadata={"help": "PEM certificate: serve gRPC over TLS (with --tls-key)"}
    )
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str | None = field(
        default=None,
        metadata={"help": "PEM CA bundle: require client certificates signed by it (mutual TLS)"},
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "the model's name in the metrics' model_name label (and the control "
            "plane's ModelInfo, which a gateway without its own --served-model-name serves "
            "it as); default: the model file's name"
        },
    )

    @property
    def tls(self) -> ServerTLS:
        return ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tls  # noqa: B018 -- validates the TLS flags
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in -1..65535, got {self.metrics_port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError(f"served_model_name must not be empty, got {self.served_model_name!r}")
