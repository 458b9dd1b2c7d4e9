"""hetero_common.tracing against OpenTelemetry's SDK (in-memory exporter)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hetero_common import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def exporter() -> Iterator[Any]:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use_tracer_provider(provider)
    yield memory
    tracing.disable_tracing()


def test_off_is_a_no_op() -> None:
    assert not tracing.tracing_enabled()
    span = tracing.start_span("x", PARENT, {"a": 1})
    assert span is tracing.NO_SPAN and span.traceparent == ""
    with span.active():
        assert tracing.current_traceparent() == ""
    span.end(error="ignored")


def test_hops_chain_through_traceparent_strings(exporter: Any) -> None:
    first = tracing.start_span("gateway", PARENT, {"hetero.request_id": "r1"}, server=True)
    with first.active():
        carried = tracing.current_traceparent()
    assert carried == first.traceparent
    assert carried.startswith(f"00-{TRACE_ID}-") and carried != PARENT
    second = tracing.start_span("control", carried)
    second.set({"gen_ai.usage.output_tokens": 3})
    second.end()
    second.end()  # ending twice exports once
    first.end(error="HTTP 503")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert len(exporter.get_finished_spans()) == 2
    g, c = spans["gateway"], spans["control"]
    assert f"{g.context.trace_id:032x}" == TRACE_ID == f"{c.context.trace_id:032x}"
    assert f"{g.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert c.parent.span_id == g.context.span_id
    assert c.attributes["gen_ai.usage.output_tokens"] == 3
    assert g.attributes["hetero.request_id"] == "r1"
    assert g.status.description == "HTTP 503" and not g.status.is_ok
    assert g.kind.name == "SERVER" and c.kind.name == "INTERNAL"


def test_a_malformed_traceparent_starts_a_new_trace(exporter: Any) -> None:
    tracing.start_span("x", "00-not-a-trace-01").end()
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.context.trace_id != 0
