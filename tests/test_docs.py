"""The reference docs list what the code has: every configuration field has a row in
docs/configuration.md under its plane, with its default where the row gives a literal,
and every Prometheus metric the three planes register has a row in docs/metrics.md with
its labels, with no row for a flag or metric that is gone; docs/api.md's OfflineLLM
example runs as written."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import prometheus_client
import pytest

import compute_plane.metrics  # noqa: F401 -- registers the planes' metrics
import control_plane.metrics  # noqa: F401
import gateway.metrics  # noqa: F401
from compute_plane.config import ComputeConfig
from control_plane.config import ControlConfig
from gateway.config import GatewayConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _rows(text: str, pattern: str) -> set[str]:
    """The names in the first column of the tables' rows (a row may name several:
    "| `--tls-cert`, `--tls-key` |"; a metric's labels follow its name)."""
    names: set[str] = set()
    for cell in re.findall(r"^\| ([^|]+) \|", text, re.M):
        names.update(re.findall(rf"`({pattern})(?:\{{[^`]*\}})?`", cell))
    return names


@pytest.mark.parametrize(
    ("heading", "config"),
    [
        ("## Compute plane", ComputeConfig),
        ("## Control plane", ControlConfig),
        ("## Gateway", GatewayConfig),
    ],
)
def test_every_flag_has_a_row_under_its_plane(heading: str, config: type) -> None:
    text = (DOCS / "configuration.md").read_text()
    rows = _rows(_section(text, heading), r"--[a-z0-9-]+")
    tls = _rows(_section(text, "## TLS"), r"--[a-z0-9-]+")
    fields = dataclasses.fields(config)
    flags = {"--" + f.name.replace("_", "-") for f in fields}
    # a boolean has a --no- form too (argparse's BooleanOptionalAction)
    offs = {"--no-" + f.name.replace("_", "-") for f in fields if "bool" in str(f.type)}
    assert flags - rows - tls == set(), "flags without a row"
    assert rows - flags - offs == set(), "rows for flags that do not exist"


def test_every_metric_has_a_row() -> None:
    registered = set()
    for collector in list(prometheus_client.REGISTRY._collector_to_names):
        for metric in getattr(collector, "describe", list)():
            if metric.name.startswith("hetero_"):
                suffix = "_total" if metric.type == "counter" else ""
                registered.add(metric.name + suffix)
    assert len(registered) > 30
    rows = _rows((DOCS / "metrics.md").read_text(), r"hetero_[a-z0-9_]+")
    assert registered - rows == set(), "metrics without a row"
    assert rows - registered == set(), "rows for metrics that are not registered"


def test_every_metric_row_names_its_labels() -> None:
    """A row's `{labels}` are the metric's labels but model_name (which every plane's
    series carry, docs/metrics.md says once), none left out and none made up."""
    registered: dict[str, set[str]] = {}
    for collector in list(prometheus_client.REGISTRY._collector_to_names):
        for metric in getattr(collector, "describe", list)():
            if metric.name.startswith("hetero_"):
                suffix = "_total" if metric.type == "counter" else ""
                labels = set(getattr(collector, "_labelnames", ())) - {"model_name"}
                registered[metric.name + suffix] = labels
    text = (DOCS / "metrics.md").read_text()
    rows: dict[str, set[str]] = {}
    for cell in re.findall(r"^\| ([^|]+) \|", text, re.M):
        for name, labels in re.findall(r"`(hetero_[a-z0-9_]+)(?:\{([^`]*)\})?`", cell):
            rows[name] = set(filter(None, labels.split(",")))
    assert {n: rows[n] for n in registered} == registered


@pytest.mark.parametrize(
    ("heading", "config"),
    [
        ("## Compute plane", ComputeConfig),
        ("## Control plane", ControlConfig),
        ("## Gateway", GatewayConfig),
    ],
)
def test_every_literal_default_is_the_fields(heading: str, config: type) -> None:
    """A row whose default is a literal (`16`, `auto`) shows the field's default; words
    ("none", "model's context length") are left to the reader."""
    text = (DOCS / "configuration.md").read_text()
    defaults = {"--" + f.name.replace("_", "-"): f.default for f in dataclasses.fields(config)}
    checked = 0
    for flags, default in re.findall(r"^\| ([^|]+) \| (`[^|]+) \|", _section(text, heading), re.M):
        names = re.findall(r"`(--[a-z0-9-]+)`", flags)
        values = re.findall(r"`([^`]+)`", default)  # "`1`, `4`" for two flags
        for name, value in zip(names, values, strict=False):
            if name in defaults and not value.startswith("$"):
                assert value == str(defaults[name]).removesuffix(".0"), name
                checked += 1
    assert checked > 5


def test_the_offline_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/api.md's OfflineLLM example, as written, on the bundled model."""
    section = _section((DOCS / "api.md").read_text(), "## In one process: `OfflineLLM`")
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    exec(compile(example, "docs/api.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].strip().startswith("Paris")
