"""Limits on one request, shared by the gateway (OpenAI validation) and the control plane.

The gateway checks them first so that errors name the OpenAI parameter; the control
plane checks them again for gRPC clients that do not come through a gateway.
"""

from __future__ import annotations

MAX_N = 16  # choices per prompt
MAX_STOPS = 4  # stop strings per request (OpenAI's own limit)
MAX_STOP_CHARS = 256  # characters in one stop string: each is searched on every delta
