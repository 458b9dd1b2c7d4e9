"""Real plane processes for end-to-end tests (built on hetero_infer.local)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from hetero_infer.local import child, free_port


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
    compute_args: tuple[str, ...] = (), control_args: tuple[str, ...] = ()
) -> Iterator[Stack]:
    """Compute plane + control plane, each its own process, bundled model on the CPU."""
    kmetrics, cmetrics = free_port(), free_port()
    with compute_plane(*compute_args, metrics_port=kmetrics) as compute:
        port = free_port()
        control = f"127.0.0.1:{port}"
        args = ["control-plane", "--port", str(port), "--compute", compute]
        with child([*args, "--metrics-port", str(cmetrics), *control_args], control):
            yield Stack(compute, control, kmetrics, cmetrics)


@dataclass
class FullStack(Stack):
    url: str = ""  # http://host:port


@contextlib.contextmanager
def gateway(control: str, port: int, *extra: str, url_path: str = "/ready") -> Iterator[str]:
    """A gateway process in front of `control`; yields its base URL once `url_path` is 200."""
    import subprocess
    import sys

    from hetero_infer.local import stop_process, wait_http_ready

    cmd = [
        sys.executable,
        "-m",
        "hetero_infer.cli",
        "gateway",
        "--port",
        str(port),
        "--control",
        control,
        *extra,
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + url_path, proc)
        yield url
    finally:
        stop_process(proc)


@contextlib.contextmanager
def gateway_stack(
    compute_args: tuple[str, ...] = (), control_args: tuple[str, ...] = ()
) -> Iterator[FullStack]:
    """All three planes as separate processes; yields once the gateway reports ready."""

    with control_stack(compute_args, control_args) as s, gateway(s.control, free_port()) as url:
        yield FullStack(s.compute, s.control, s.compute_metrics, s.control_metrics, url)
