"""llguidance's error messages as a client can read them (the gateway's tool checks and
the control plane's grammar compiles both quote them)."""

from __future__ import annotations

import re

# serde_json's position of an error, in JSON text llguidance was given: a schema as we
# serialised it again, or the call schema the gateway wraps a tool's parameters in; never
# the text the client sent, whose lines and columns it does not match.
_POSITION = re.compile(r" at line \d+ column \d+")


def readable(error: str) -> str:
    """`error` without serde's line and column, its recursion limit said as a limit."""
    return _POSITION.sub("", error).replace(
        "recursion limit exceeded",
        "nested too deeply (the grammar compiler reads at most 128 levels of JSON)",
    )
