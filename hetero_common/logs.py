"""Process logging: plain text for people, one JSON object per line for log collectors.

A request id follows a request through the three processes: the gateway takes the
client's `X-Request-Id` (or makes one) and names the control plane's request after it;
the control plane names each choice `<id>-<i>` toward the compute plane
(`choice_request_id`). Each plane's per-request lines carry it as `request_id`: in the
gateway from the request's context (`REQUEST_ID`), in the gRPC planes as
`extra={"request_id": ...}` (one step loop serves every request there, so no context).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The request the current task serves (the gateway sets it per HTTP request).
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)

# What we accept as a client's request id: short, printable, safe in headers and logs.
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def valid_request_id(value: str | None) -> bool:
    return bool(value) and _REQUEST_ID_RE.fullmatch(value or "") is not None


def choice_request_id(request_id: str, index: int) -> str:
    """The compute plane's id of choice `index` of a request."""
    return f"{request_id}-{index}"


def split_choice_id(choice_id: str) -> tuple[str, int | None]:
    """`<id>-<i>` -> (id, i); an id not of that shape -> (id, None)."""
    head, _, tail = choice_id.rpartition("-")
    return (head, int(tail)) if head and tail.isdigit() else (choice_id, None)


class JsonFormatter(logging.Formatter):
    """ts, level, logger, message, and request_id (and choice) when the record has one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        choice = getattr(record, "choice", None)
        if choice is not None:
            entry["choice"] = choice
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    """The plain format, with ` [request_id]` after the message when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        return f"{line} [{request_id}]" if request_id else line


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger of this process (stderr); replaces earlier handlers."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else _TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings as log records too (one format on stderr)
