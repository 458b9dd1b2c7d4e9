"""Optional OpenTelemetry traces: one span per request in each process it passes.

Off unless a process is started with `--otlp-traces-endpoint` (OTLP over gRPC, e.g. a
collector at `http://otel-collector:4317`); that needs the `otel` extra
(`pip install "hetero-paged-infer[otel]"`). With tracing off every call here is a
no-op and OpenTelemetry is never imported.

The trace follows a request as a W3C `traceparent` string: the gateway's span (child of
the client's `traceparent` header, if any) is the parent of the control plane's span
(`GenerateRequest.traceparent`), which is the parent of each choice's span in the
compute plane (`NewRequest.traceparent`). A field, not gRPC metadata: GenerateMany and
the compute plane's Run stream carry many requests on one call.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

AttributeValue = str | int | float | bool

_tracer: Any = None  # an opentelemetry Tracer once setup_tracing ran with an endpoint


def setup_tracing(service: str, endpoint: str | None) -> None:
    """Export this process's spans to `endpoint` (OTLP/gRPC) as `service`; None: off."""
    global _tracer
    if not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ValueError(
            '--otlp-traces-endpoint needs OpenTelemetry: pip install "hetero-paged-infer[otel]"'
        ) from e
    insecure = not endpoint.startswith("https://")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure))
    )
    atexit.register(provider.shutdown)  # flush what is left on a clean exit (drain)
    use_tracer_provider(provider)


def use_tracer_provider(provider: Any) -> None:
    """Trace with this opentelemetry TracerProvider (tests: an in-memory exporter)."""
    global _tracer
    _tracer = provider.get_tracer("hetero-paged-infer")


def disable_tracing() -> None:
    global _tracer
    _tracer = None


def tracing_enabled() -> bool:
    return _tracer is not None


class RequestSpan:
    """A span that is started and ended by hand (a request outlives any one call)."""

    @property
    def traceparent(self) -> str:
        """This span as a W3C traceparent, for the next hop ("" when off)."""
        return ""

    def set(self, attributes: Mapping[str, AttributeValue]) -> None:
        """Set attributes (OpenTelemetry names: `gen_ai.usage.input_tokens`)."""

    def end(self, error: str | None = None) -> None:
        """End it; `error` marks it failed with that description."""

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make it the current span (the gateway: while serving its HTTP request)."""
        yield


NO_SPAN = RequestSpan()


class _OtelSpan(RequestSpan):
    def __init__(self, span: Any) -> None:
        self.span = span
        self._traceparent: str | None = None
        self._ended = False

    @property
    def traceparent(self) -> str:
        if self._traceparent is None:
            from opentelemetry import trace

            self._traceparent = _inject(trace.set_span_in_context(self.span))
        return self._traceparent

    def set(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.span.set_attributes(attributes)

    def end(self, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()

    @contextmanager
    def active(self) -> Iterator[None]:
        from opentelemetry import trace

        with trace.use_span(self.span, end_on_exit=False):
            yield


def start_span(
    name: str,
    traceparent: str = "",
    attributes: Mapping[str, AttributeValue] | None = None,
    server: bool = False,
) -> RequestSpan:
    """A span named `name`, child of `traceparent` (else of the current span, if any).

    server: the span of a request this process received over the network (kind SERVER).
    """
    if _tracer is None:
        return NO_SPAN
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    # A malformed traceparent (a client's header) starts a new trace.
    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    span = _tracer.start_span(
        name,
        context=parent if traceparent else None,  # None: the current span's context
        kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
        attributes=attributes,
    )
    return _OtelSpan(span)


def current_traceparent() -> str:
    """The current span (see RequestSpan.active) as a traceparent; "" when none or off."""
    if _tracer is None:
        return ""
    from opentelemetry import context

    return _inject(context.get_current())


def _inject(ctx: Any) -> str:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=ctx)
    return carrier.get("traceparent", "")
