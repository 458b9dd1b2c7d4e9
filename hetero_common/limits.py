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
MAX_TEMPERATURE = 2.0  # OpenAI's range, 0..2
MAX_REPETITION_PENALTY = 10.0  # (0, 10]: past it every seen token is all but banned
# Largest request message the control plane takes (grpc's default limit, 4 MiB): a larger
# one is RESOURCE_EXHAUSTED, for that request alone. The gateway refuses a larger one
# itself (413), naming the HTTP request.
MAX_GRPC_MESSAGE_BYTES = 4 << 20
# What the control plane's gRPC server reads at all: a GenerateMany start between the two
# limits is read and refused alone (its RequestError); one past this ends the whole call,
# as gRPC must end a call whose message it will not read.
MAX_RECEIVE_BYTES = 4 * MAX_GRPC_MESSAGE_BYTES
# The link between a control plane and its compute planes reads messages of any size
# (gRPC's -1; protobuf's own 2 GiB remains). What one step carries is bounded by the
# configuration, not by the client: new requests in full (every known token id, up to
# max_num_seqs x max_model_len ids), a grammar mask per constrained request (up to a
# vocabulary's bits each), prompt logprobs of up to max_num_batched_tokens positions with
# up to MAX_TOP_LOGPROBS alternatives each. 256 requests admitted in one step on a cached
# 8000-token prefix are a 6 MB step: past gRPC's default 4 MiB it ended the Run stream,
# and the control plane took the compute plane for lost.
LINK_MAX_MESSAGE_BYTES = -1
# Most bytes the new requests of one step take on the link (each is sent in full: every
# known token and its whole page table). A cached prefix costs the compute plane nothing,
# so nothing else bounds them: thousands of long prompts on one cached prefix made a step
# past protobuf's 2 GiB, which cannot be serialised (a ValueError in the step loop: every
# request of the compute plane failed INTERNAL). Past this the next waiting requests start
# in the next step; one alone is always admitted (max_model_len ids: a few MB).
STEP_NEW_REQUEST_BYTES = 256 << 20
# Chat roles whose turn is nothing without content: left out or null is refused, as OpenAI
# refuses it (an assistant turn may be only tool calls, and a template's own roles are
# the template's business).
CONTENT_REQUIRED = ("system", "developer", "user", "tool")
