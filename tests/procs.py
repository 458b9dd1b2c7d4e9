"""Real plane processes for end-to-end tests (built on hetero_infer.local)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from hetero_infer.local import (
    Front,
    child,
    free_port,
    spawned,
    start_planes,
    wait_http_ready,
    wait_serving,
)


@contextlib.contextmanager
def compute_plane(
    *extra: str, port: int | None = None, metrics_port: int | None = None
) -> Iterator[str]:
    """A compute plane with the bundled model on a free port; yields its address."""
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    metrics = str(metrics_port or free_port())
    with child(["compute-plane", "--port", str(port), "--metrics-port", metrics, *extra], address):
        yield address


@dataclass
class Stack:
    compute: str
    control: str
    compute_metrics: int = 0  # /metrics ports
    control_metrics: int = 0


@contextlib.contextmanager
def control_stack(
    compute_args: tuple[str, ...] = (),
    control_args: tuple[str, ...] = (),
    front: Front | None = None,
) -> Iterator[Stack]:
    """Compute plane + control plane, each its own process, bundled model on the CPU,
    started at once (`start_planes`; `front` as there)."""
    kmetrics, cmetrics = free_port(), free_port()
    kport, port = free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{port}"
    kargs = ["compute-plane", "--port", str(kport), "--metrics-port", str(kmetrics)]
    args = ["control-plane", "--port", str(port), "--compute", compute]
    args += ["--metrics-port", str(cmetrics), *control_args]
    with start_planes([([*kargs, *compute_args], compute)], (args, control), front=front):
        yield Stack(compute, control, kmetrics, cmetrics)


@dataclass
class FullStack(Stack):
    url: str = ""  # http://host:port


@contextlib.contextmanager
def gateway(control: str, port: int, *extra: str, url_path: str = "/ready") -> Iterator[str]:
    """A gateway process in front of `control`; yields its base URL once `url_path` is 200."""
    with gateway_started(control, port, *extra) as (url, proc):
        wait_http_ready(url + url_path, proc)
        yield url


@contextlib.contextmanager
def gateway_started(
    control: str, port: int, *extra: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A gateway process in front of `control`, not yet waited on: (its URL, process)."""
    args = ["gateway", "--port", str(port), "--control", control, *extra]
    with spawned(args) as proc:
        yield f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def gateway_stack(
    compute_args: tuple[str, ...] = (), control_args: tuple[str, ...] = ()
) -> Iterator[FullStack]:
    """All three planes as separate processes, the control plane and the gateway started
    while the compute plane loads; yields once the gateway reports ready."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []

    @contextlib.contextmanager
    def front(control: str) -> Iterator[None]:
        with gateway_started(control, free_port()) as gw:
            started.append(gw)
            yield

    with control_stack(compute_args, control_args, front) as s:
        url, proc = started[0]
        wait_http_ready(url + "/ready", proc)
        yield FullStack(s.compute, s.control, s.compute_metrics, s.control_metrics, url)


@contextlib.contextmanager
def control_gateway(control_args: list[str], control: str) -> Iterator[str]:
    """A control plane (`hetero-infer CONTROL_ARGS`, serving on `control`) and a gateway
    in front of it, started as soon as the control plane listens; yields the gateway's
    URL once it is ready."""
    with spawned(control_args) as proc:
        wait_serving(control, proc, listening=True)
        with gateway_started(control, free_port()) as (url, gw):
            wait_serving(control, proc)
            wait_http_ready(url + "/ready", gw)
            yield url
