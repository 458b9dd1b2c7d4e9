"""The gateway's one config dataclass (CLI flags and --config JSON map onto it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

API_KEY_ENV = "HETERO_API_KEY"


@dataclass
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind the HTTP server to"})
    port: int = field(default=8000, metadata={"help": "HTTP port of the OpenAI API"})
    control: str = field(
        default="127.0.0.1:50051", metadata={"help": "control plane address HOST:PORT"}
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name clients use (default: the control plane's)"}
    )
    api_key: str | None = field(
        default=None,
        metadata={"help": f"require 'Authorization: Bearer KEY' on /v1/* (or set {API_KEY_ENV})"},
    )
    request_timeout: float = field(
        default=600.0, metadata={"help": "seconds before a request is cancelled"}
    )

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
