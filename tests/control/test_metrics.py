"""observe_many: the same histogram as `count` separate observations."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from control_plane.metrics import LATENCY_BUCKETS, observe_many


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def _histogram(registry: CollectorRegistry) -> Histogram:
    parent = Histogram(
        "h_seconds", "test", ("model_name",), buckets=LATENCY_BUCKETS, registry=registry
    )
    return parent.labels(model_name="m")


values = st.one_of(
    st.sampled_from(LATENCY_BUCKETS),  # exactly on a bucket bound: that bucket (le)
    st.floats(min_value=0.0, max_value=500.0, allow_nan=False),  # incl. past the last: +Inf
)


@given(st.lists(st.tuples(values, st.integers(1, 300)), max_size=6))
def test_observe_many_equals_repeated_observe(batches: list[tuple[float, int]]) -> None:
    once, many = CollectorRegistry(), CollectorRegistry()
    h_once, h_many = _histogram(once), _histogram(many)
    for value, count in batches:
        for _ in range(count):
            h_once.observe(value)
        observe_many(h_many, value, count)
    want, got = _samples(once), _samples(many)
    assert want.keys() == got.keys()
    for key, value in want.items():
        if key[0].endswith("_sum"):
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12)
        else:
            assert got[key] == value, key


def test_observe_many_falls_back_to_observe_without_the_internals() -> None:
    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, value: float) -> None:
            self.seen.append(value)

    plain = Plain()
    observe_many(plain, 0.25, 3)  # type: ignore[arg-type]
    assert plain.seen == [0.25, 0.25, 0.25]
