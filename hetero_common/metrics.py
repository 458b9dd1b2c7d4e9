"""What the planes' Prometheus metrics share."""

from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase


def forget_series(metrics: list[MetricWrapperBase], label: str, value: str) -> None:
    """Remove every series of `metrics` whose `label` is `value` (a peer that left: with
    discovery, peers come and go under new addresses, and each would leave its series
    behind, with their last values, for as long as the process runs)."""
    for metric in metrics:
        names = list(metric._labelnames)  # (prometheus_client keeps children by values)
        if label not in names:
            continue
        at = names.index(label)
        with metric._lock:
            gone = [v for v in metric._metrics if v[at] == value]
        for values in gone:
            metric.remove(*values)
