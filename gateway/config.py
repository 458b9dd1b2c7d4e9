"""The gateway's one config dataclass (CLI flags and --config JSON map onto it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hetero_common.discovery import targets
from hetero_common.server_config import ServerConfig
from hetero_common.tls import ClientTLS

API_KEY_ENV = "HETERO_API_KEY"


@dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    port: int = field(default=8000, metadata={"help": "HTTP port of the OpenAI API"})
    control: str = field(
        default="127.0.0.1:50051",
        metadata={
            "help": "control planes: HOST:PORT[,HOST:PORT...]; a host name stands for every "
            "address it resolves to (a Kubernetes headless Service: one per ready pod), "
            "read again every --control-resolve-interval seconds"
        },
    )
    control_resolve_interval: float = field(
        default=5.0,
        metadata={
            "help": "seconds between re-resolving --control's host names and probing "
            "every control plane (planes join and leave)"
        },
    )
    control_retry_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds a request whose control plane failed waits for another one "
            "to be up before it fails with 503"
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name clients use (default: the control plane's)"}
    )
    api_key: str | None = field(
        default=None,
        metadata={"help": f"require 'Authorization: Bearer KEY' on /v1/* (or set {API_KEY_ENV})"},
    )
    request_timeout: float = field(
        default=600.0,
        metadata={"help": "seconds a request may run; then it is cancelled (HTTP 504)"},
    )
    max_body_bytes: int = field(
        default=2 << 20, metadata={"help": "largest accepted request body (larger: HTTP 413)"}
    )
    header_timeout: float = field(
        default=10.0,
        metadata={"help": "seconds a connection may take to send a request's headers; then closed"},
    )
    body_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds the request body may pause between reads (then HTTP 408)"},
    )
    max_idle_connections_per_ip: int = field(
        default=256,
        metadata={
            "help": "connections one client address may hold waiting for headers; past it, "
            "its oldest one that has waited a second or more is closed"
        },
    )
    control_tls_ca: str | None = field(
        default=None,
        metadata={"help": "PEM CA bundle: dial the control plane over TLS, verified by it"},
    )
    control_tls_cert: str | None = field(
        default=None, metadata={"help": "PEM client certificate for the control plane (mTLS)"}
    )
    control_tls_key: str | None = field(
        default=None, metadata={"help": "PEM private key of --control-tls-cert"}
    )

    @property
    def control_tls(self) -> ClientTLS:
        return ClientTLS(
            self.control_tls_ca, self.control_tls_cert, self.control_tls_key, "control-tls"
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.control_tls  # noqa: B018 -- validates the TLS flags
        if self.api_key is None:  # frozen: set once, here
            object.__setattr__(self, "api_key", os.environ.get(API_KEY_ENV) or None)
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        targets(self.control)  # ValueError names a malformed address
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError(f"served_model_name must not be empty, got {self.served_model_name!r}")
        for name in (
            "request_timeout",
            "header_timeout",
            "body_timeout",
            "control_resolve_interval",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.control_retry_timeout >= 0:  # NaN too
            raise ValueError(
                f"control_retry_timeout must be >= 0, got {self.control_retry_timeout}"
            )
        if self.max_idle_connections_per_ip < 1:
            raise ValueError(
                f"max_idle_connections_per_ip must be >= 1, got {self.max_idle_connections_per_ip}"
            )
