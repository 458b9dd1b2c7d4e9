"""Optional TLS, and mutual TLS, on the two gRPC links (gateway -> control -> compute).

Without certificates a link is plaintext, as on loopback. With them it fails closed:
a configured file that cannot be read stops the process at start-up, a server given a
client CA refuses clients without a certificate it signed, and a client given a CA
refuses a server whose certificate it did not sign. Certificates must name the host
the peer dials (e.g. the Kubernetes Service name, or 127.0.0.1 as an IP SAN).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

# How a client channel retries a lost connection: after 0.1 s at first, then at most every
# half second. gRPC's defaults (1 s, growing 1.6x to 2 minutes) leave a plane that came
# back unused for about as long again as it had been away: a compute plane back after
# 40 s was attached 25 s later, close to --compute-timeout (60 s), when the requests that
# wait for it fail. A compute plane started with its control plane (`serve`) is attached
# within ~0.5 s of listening (with at most 1 s between tries, 0.35 s after it was serving).
RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--{flag}: cannot read {path}: {e.strerror or e}") from e


@dataclass(frozen=True)
class ServerTLS:
    """A gRPC server's certificate; with `client_ca`, clients must present one too (mTLS)."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    prefix: str = "tls"  # flag names in messages: --{prefix}-cert ...

    def __post_init__(self) -> None:
        p = self.prefix
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"--{p}-cert and --{p}-key must be given together")
        if self.client_ca is not None and self.cert is None:
            raise ValueError(f"--{p}-client-ca needs --{p}-cert and --{p}-key")

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def credentials(self) -> grpc.ServerCredentials:
        assert self.cert is not None and self.key is not None, "TLS is not configured"
        p = self.prefix
        pair = (_read(self.key, f"{p}-key"), _read(self.cert, f"{p}-cert"))
        client_ca = _read(self.client_ca, f"{p}-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )

    def add_port(self, server: grpc.aio.Server, address: str) -> None:
        if self.enabled:
            server.add_secure_port(address, self.credentials())
        else:
            server.add_insecure_port(address)


@dataclass(frozen=True)
class ClientTLS:
    """How a client dials a server: TLS when `ca` is set; `cert` + `key` add mTLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = "tls"

    def __post_init__(self) -> None:
        p = self.prefix
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"--{p}-cert and --{p}-key must be given together")
        if self.cert is not None and self.ca is None:
            raise ValueError(f"--{p}-cert needs --{p}-ca (the CA that signed the server)")

    @property
    def enabled(self) -> bool:
        return self.ca is not None

    def credentials(self) -> grpc.ChannelCredentials:
        assert self.ca is not None, "TLS is not configured"
        p = self.prefix
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, f"{p}-ca"),
            private_key=_read(self.key, f"{p}-key") if self.key else None,
            certificate_chain=_read(self.cert, f"{p}-cert") if self.cert else None,
        )

    def aio_channel(
        self, address: str, options: list[tuple[str, Any]] | None = None
    ) -> grpc.aio.Channel:
        """A channel to `address` that reconnects as RECONNECT_OPTIONS say (`options` may
        override them)."""
        options = [*RECONNECT_OPTIONS, *(options or [])]
        if self.enabled:
            return grpc.aio.secure_channel(address, self.credentials(), options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def channel(self, address: str) -> grpc.Channel:
        if self.enabled:
            return grpc.secure_channel(address, self.credentials(), RECONNECT_OPTIONS)
        return grpc.insecure_channel(address, RECONNECT_OPTIONS)
