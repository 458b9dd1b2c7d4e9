"""Real plane processes for end-to-end tests (built on hetero_infer.local)."""

from __future__ import annotations

import contextlib
import functools
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from compute_plane.host_memory import memory_available
from hetero_infer.local import (
    Front,
    child,
    free_port,
    gateway_process,
    start_planes,
    wait_http_ready,
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
def _planes(
    compute_args: tuple[str, ...], control_args: tuple[str, ...], front: Front | None = None
) -> Iterator[tuple[Stack, object]]:
    """A compute plane and a control plane on free ports, started at once (`start_planes`,
    `front` as there): the stack, and what `front` gave."""
    kmetrics, cmetrics = free_port(), free_port()
    kport, port = free_port(), free_port()
    compute, control = f"127.0.0.1:{kport}", f"127.0.0.1:{port}"
    kargs = ["compute-plane", "--port", str(kport), "--metrics-port", str(kmetrics)]
    args = ["control-plane", "--port", str(port), "--compute", compute]
    args += ["--metrics-port", str(cmetrics), *control_args]
    with start_planes([([*kargs, *compute_args], compute)], (args, control), front=front) as out:
        yield Stack(compute, control, kmetrics, cmetrics), out


@contextlib.contextmanager
def control_stack(
    compute_args: tuple[str, ...] = (), control_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """Compute plane + control plane, each its own process, bundled model on the CPU,
    started at once."""
    with _planes(compute_args, control_args) as (stack, _):
        yield stack


@dataclass
class FullStack(Stack):
    url: str = ""  # http://host:port


@contextlib.contextmanager
def gateway(control: str, port: int, *extra: str, url_path: str = "/ready") -> Iterator[str]:
    """A gateway process in front of `control`; yields its base URL once `url_path` is 200."""
    with gateway_process(control, port, *extra) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url + url_path, proc)
        yield url


def _ready(port: int, gw: object) -> str:
    """The URL of the gateway `gw` on `port`, once its /ready is 200."""
    assert isinstance(gw, subprocess.Popen)
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(url + "/ready", gw)
    return url


@contextlib.contextmanager
def gateway_stack(
    compute_args: tuple[str, ...] = (), control_args: tuple[str, ...] = ()
) -> Iterator[FullStack]:
    """All three planes as separate processes, the control plane and the gateway started
    while the compute plane loads; yields once the gateway reports ready."""
    port = free_port()
    front = functools.partial(gateway_process, port=port)
    with _planes(compute_args, control_args, front) as (s, gw):
        url = _ready(port, gw)
        yield FullStack(s.compute, s.control, s.compute_metrics, s.control_metrics, url)


@contextlib.contextmanager
def control_gateway(control_args: list[str], control: str) -> Iterator[str]:
    """A control plane (`hetero-infer CONTROL_ARGS`, serving on `control`, its compute
    planes already up) and a gateway in front of it, started as soon as the control plane
    listens; yields the gateway's URL once it is ready."""
    port = free_port()
    front = functools.partial(gateway_process, port=port)
    with start_planes([], (control_args, control), front=front) as gw:
        yield _ready(port, gw)


def memory_left() -> int:
    """The bytes a plane started now could take (what its memory checks read:
    compute_plane.host_memory); the test is skipped where that is unknown."""
    found = memory_available()
    if found is None:
        pytest.skip("the memory available is unknown here (no /proc/meminfo, no cgroup)")
    return found[1]
