"""Limits on one request, shared by the gateway (OpenAI validation), the control plane and
the compute plane.

The gateway checks them first so that errors name the OpenAI parameter; the control
plane checks them again for gRPC clients that do not come through a gateway.
"""

from __future__ import annotations

MAX_N = 16  # choices per prompt
MAX_STOPS = 4  # stop strings per request (OpenAI's own limit)
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's own limit)
MAX_STOP_CHARS = 256  # characters in one stop string: each is searched on every delta
# Largest message a gRPC server takes by default (grpc's own 4 MiB): the control plane
# receives each generate request as one message, so the gateway refuses a larger one
# itself (413) rather than let it end the GenerateMany call that all its requests share.
MAX_GRPC_MESSAGE_BYTES = 4 << 20
