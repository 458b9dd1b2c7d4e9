"""The Grafana dashboard (deploy/monitoring/) loads in Grafana's schema and queries only
metrics that the three planes export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import compute_plane.metrics
import control_plane.metrics
import gateway.metrics  # noqa: F401 -- registers the gateway's metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/monitoring/hetero-paged-infer.json"
# The series a metric family exposes, by its type (prometheus_client's names).
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}


def _dashboard() -> dict:  # type: ignore[type-arg]
    return json.loads(DASHBOARD.read_text())


def _queries(d: dict) -> list[str]:  # type: ignore[type-arg]
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    return exprs + [v["query"] for v in d["templating"]["list"] if v["type"] == "query"]


def test_the_dashboard_round_trips_through_grafanas_schema_types() -> None:
    """grafana-foundation-sdk's models are generated from Grafana's dashboard schema:
    a key they do not know (a typo, a field of another version) is dropped on the way
    through, and the comparison fails."""
    sdk = pytest.importorskip("grafana_foundation_sdk.models.dashboard")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    data = _dashboard()
    again = json.loads(json.dumps(sdk.Dashboard.from_json(data), cls=JSONEncoder))
    assert again == data


def test_the_dashboard_is_well_formed() -> None:
    d = _dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in d["templating"]["list"]}
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"], p["title"]
            used = set(re.findall(r"\$\{?(\w+)", t["expr"] + t["datasource"]["uid"]))
            assert used - {"__rate_interval"} <= variables, (p["title"], used)


def _families() -> dict[str, str]:
    return {m.name: m.type for m in REGISTRY.collect() if m.name.startswith("hetero_")}


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    families = _families()
    assert "hetero_compute_step_duration_seconds" in families  # the registry was read
    queried = {n for q in _queries(_dashboard()) for n in re.findall(r"\bhetero_\w+", q)}
    missing = []
    for name in sorted(queried):
        if not any(
            name == base + suffix
            for base, kind in families.items()
            for suffix in SUFFIXES.get(kind, ("",))
        ):
            missing.append(name)
    assert not missing, f"queried but not exported: {missing}"


def test_the_dashboard_covers_what_operators_watch() -> None:
    text = " ".join(_queries(_dashboard()))
    for needed in (
        "hetero_generation_tokens_total",  # throughput
        "hetero_time_to_first_token_seconds_bucket",
        "hetero_inter_token_latency_seconds_bucket",
        "hetero_kv_cache_usage_ratio",
        "hetero_requests_waiting",
        "hetero_preemptions_total",
        "by (instance)",  # per compute plane
    ):
        assert needed in text, needed
    assert compute_plane.metrics.step_duration and control_plane.metrics.ttft


def test_ratios_divide_by_their_denominator() -> None:
    """A ratio of rates is divided by the denominator's rate itself, filtered to > 0 where
    it may be 0 (no data then): clamp_min(..., 1) divided a prefix hit rate by 1 whenever
    fewer than one prompt token a second was looked up (one 20-token request a minute:
    a third of the true rate)."""
    for q in _queries(_dashboard()):
        assert not re.search(r"/\s*clamp_min\(", q), q
