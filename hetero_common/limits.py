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
# Largest request message the control plane takes (grpc's default limit, 4 MiB): a larger
# one is RESOURCE_EXHAUSTED, for that request alone. The gateway refuses a larger one
# itself (413), naming the HTTP request.
MAX_GRPC_MESSAGE_BYTES = 4 << 20
# What the control plane's gRPC server reads at all: a GenerateMany start between the two
# limits is read and refused alone (its RequestError); one past this ends the whole call,
# as gRPC must end a call whose message it will not read.
MAX_RECEIVE_BYTES = 4 * MAX_GRPC_MESSAGE_BYTES
