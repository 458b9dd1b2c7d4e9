"""Start planes as child processes on loopback (for `generate` and `serve`)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_common.cpus import usable_cpus

START_TIMEOUT = 300.0  # seconds a plane may take to be serving, unless told otherwise
PLANES = ("compute-plane", "control-plane", "gateway")
# The pid of the process that started this one with `spawned`: it ends when that does.
PARENT_ENV = "HETERO_INFER_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a process `spawned` started: get SIGTERM when the process that started it ends,
    killed too (SIGKILL, the OOM killer), so that a plane stops, and frees its port and
    memory, as it would had its parent stopped it; exit at once when that parent is gone
    already. Armed in the child itself, first thing (a preexec_fn is unsafe in a process
    with threads); nothing where the variable is unset or not on Linux."""
    parent = os.environ.pop(PARENT_ENV, None)  # (not for this process's own children)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # it died before the signal was armed
        os._exit(1)


class PlaneExited(RuntimeError):
    """A plane's process ended before it was serving; the message names the plane, its
    exit status and (for a quiet one, whose output is not shown) its last error line."""

    def __init__(self, proc: subprocess.Popen[bytes], when: str) -> None:
        args = [str(a) for a in proc.args]  # type: ignore[union-attr]
        name = next((a.replace("-", " ") for a in args if a in PLANES), " ".join(args))
        why = _last_error(proc)
        code = proc.returncode
        ended = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        if not why and code > 0:
            why = "its error is above"
        super().__init__(f"the {name} {ended} {when}" + (f": {why}" if why else ""))


class StartStopped(Exception):
    """A stop signal came while the planes were starting (`stopping` turned true)."""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# A quiet child's stderr goes to a file instead of nowhere: its last line says why it
# failed to start.
_stderr: weakref.WeakKeyDictionary[subprocess.Popen[bytes], IO[bytes]] = weakref.WeakKeyDictionary()


def _last_error(proc: subprocess.Popen[bytes]) -> str:
    log = _stderr.get(proc)
    if log is None:
        return ""
    log.seek(0)
    lines = [line.strip() for line in log.read().decode(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    ours = [line for line in lines if line.startswith("hetero-infer")]
    return (ours or lines or [""])[-1].removeprefix("hetero-infer: error: ")


_EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL


def free_port() -> int:
    """A loopback port that is free now and that nothing else is likely to take before the
    caller's child binds it.

    A port the kernel hands out for bind(0) is an ephemeral one: until the child binds it,
    any outgoing connection or bind(0) on the machine (a gRPC channel, another plane's
    metrics server) may get the same port, and the child then fails with "address already
    in use". So pick at random among the ports below the ephemeral range (above it where
    that has no room), which the kernel never hands out, skip those this process already
    gave, and check that it binds."""
    low, high = _ephemeral_range()
    span = (10000, low - 1) if low > 12000 else (high + 1, 65535)
    if span[1] - span[0] < 1000:  # no room outside the range: let the kernel pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(*span)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {span[0]}-{span[1]}")


class PortUnavailable(OSError):
    """A port serve was given cannot be listened on (in use, or not an address here)."""


def listener(host: str, port: int) -> socket.socket:
    """A socket listening on host:port as a plane will listen there (SO_REUSEADDR, as
    uvicorn, gRPC and the metrics server bind): the one test that a port serve was given
    is free, for every flag that names one. OSError when it cannot be; the caller closes
    it (letting the port go)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen()
    except OSError:
        s.close()
        raise
    return s


def check_ports(ports: list[tuple[str, str, int]]) -> None:
    """Listen on each (flag, host, port) at once (`listener`) and let them go:
    PortUnavailable naming the first that cannot be, before anything starts (a plane found
    out only once the compute plane had loaded its model). Port 0 (any) and -1 (none) are
    skipped."""
    with contextlib.ExitStack() as held:
        for flag, host, port in ports:
            if port <= 0:
                continue
            try:
                held.enter_context(listener(host, port))
            except OSError as e:
                where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                raise PortUnavailable(
                    f"{flag} {port}: cannot listen on {where}: {e.strerror or e}"
                ) from None


def wait_serving(
    address: str,
    proc: subprocess.Popen[bytes],
    timeout: float = START_TIMEOUT,
    credentials: grpc.ChannelCredentials | None = None,
    listening: bool = False,
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Poll grpc.health.v1 until SERVING (with `listening`: until it answers at all, as a
    control plane does before a compute plane is attached); raise if the process dies
    first, StartStopped once `stopping()` turns true."""
    deadline = time.monotonic() + timeout
    # A refused connection retried within 0.1 s: with gRPC's defaults (after 1 s, then
    # 1.6, 2.6, 4.1 s...) a control plane was seen serving 1.3-2 s after it was.
    options = [
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 100),
    ]
    channel = (
        grpc.secure_channel(address, credentials, options)
        if credentials
        else grpc.insecure_channel(address, options)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if stopping():
                raise StartStopped
            if proc.poll() is not None:
                raise PlaneExited(proc, "before serving")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if listening or status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} not serving after {timeout:.0f} s")


# A plane stopped with SIGTERM drains for up to its --drain-timeout (30 s unless set):
# it is killed only after that and a little more, not in the middle of its drain.
STOP_TIMEOUT = 35.0


def stop_process(proc: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def child(
    args: list[str],
    address: str,
    quiet: bool = False,
    credentials: grpc.ChannelCredentials | None = None,
    timeout: float = START_TIMEOUT,
) -> Iterator[subprocess.Popen[bytes]]:
    """`hetero-infer ARGS` as a child process; yielded once its gRPC health is SERVING
    (TimeoutError, the process stopped, if it is not within `timeout` seconds)."""
    with spawned(args, quiet) as proc:
        wait_serving(address, proc, timeout=timeout, credentials=credentials)
        yield proc


@contextlib.contextmanager
def gateway_process(
    control: str, port: int, *extra: str, quiet: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """A gateway on `port` in front of the control plane at `control` (not waited on),
    stopped at the end of the block."""
    with spawned(["gateway", "--port", str(port), "--control", control, *extra], quiet) as proc:
        yield proc


@contextlib.contextmanager
def spawned(args: list[str], quiet: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    """`hetero-infer ARGS` as a child process, stopped (SIGTERM) at the end of the block,
    or when this process ends any other way (`die_with_parent`: the signal comes when the
    thread that started it ends, so start it on one that outlives it, as the main one)."""
    out = subprocess.DEVNULL if quiet else None
    with contextlib.ExitStack() as files:
        err = files.enter_context(tempfile.TemporaryFile()) if quiet else None
        # A process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group)
        # reaches this process alone, which stops the child (SIGTERM, a drain); a child
        # that had it too died of it while starting (a KeyboardInterrupt traceback from
        # its imports, or exit 130 during its load) and serve reported it as a failure.
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetero_infer.cli", *args],
            stdout=out,
            stderr=err,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            process_group=0,
        )
        if err is not None:
            _stderr[proc] = err
        try:
            yield proc
        finally:
            stop_process(proc)


Front = Callable[[str], contextlib.AbstractContextManager[object]]


def compute_metrics_ports(first: int, num_compute: int) -> list[int]:
    """The /metrics ports of `num_compute` compute planes: consecutive from `first`, so that
    a scrape config can list them (0: each picks a free one and logs it; -1: none)."""
    return [first + i if first > 0 else first for i in range(num_compute)]


@contextlib.contextmanager
def local_planes(
    model: str,
    quiet: bool = True,
    extra_compute: tuple[str, ...] = (),
    metrics_ports: tuple[int, int] | None = None,
    log_args: tuple[str, ...] = (),
    extra_control: tuple[str, ...] = (),
    num_compute: int = 1,
    start_timeout: float | None = None,
    front: Front | None = None,
    children: list[subprocess.Popen[bytes]] | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> Iterator[str]:
    """Compute and control planes on free loopback ports (`start_planes`); yields the
    control plane address once it is serving.

    metrics_ports: the (compute, control) /metrics ports (0: the plane picks a free one and
    logs it; -1: none); default: free ones. With several compute planes (`num_compute`,
    data parallel behind the one control plane) compute plane i gets the compute port + i
    (`compute_metrics_ports`), and each gets an equal share of this process's CPUs unless
    extra_compute sets --num-threads.
    log_args: --log-level / --log-format flags for both. start_timeout: seconds for all of
    them to be serving (TimeoutError, each stopped); default: START_TIMEOUT for each.
    stopping: StartStopped (each stopped) once it turns true while they start.
    """
    cpus = usable_cpus()
    if not 1 <= num_compute <= cpus:  # (10000 started 10000 processes, each loading the model)
        raise ValueError(
            f"--compute-planes must be in 1..{cpus}, got {num_compute}: each compute plane "
            f"takes at least one of the {cpus} CPUs this process may use"
        )
    cport = free_port()
    kports = [free_port() for _ in range(num_compute)]
    if metrics_ports is None:
        kmetrics, cmetrics = [free_port() for _ in kports], free_port()
    else:
        kmetrics, cmetrics = compute_metrics_ports(metrics_ports[0], num_compute), metrics_ports[1]
    computes = [f"127.0.0.1:{kport}" for kport in kports]
    control = f"127.0.0.1:{cport}"
    control_args = ["control-plane", *log_args, "--model", model, "--port", str(cport)]
    control_args += ["--compute", ",".join(computes)]
    control_args += ["--metrics-port", str(cmetrics), *extra_control]
    threads: tuple[str, ...] = ()
    if num_compute > 1 and not any(a.startswith("--num-threads") for a in extra_compute):
        share = cpus // num_compute
        threads = ("--num-threads", str(share))
    compute_planes = []
    for kport, compute, port in zip(kports, computes, kmetrics, strict=True):
        args = ["compute-plane", *log_args, "--model", model, "--port", str(kport)]
        compute_planes.append(
            ([*args, "--metrics-port", str(port), *threads, *extra_compute], compute)
        )
    with start_planes(
        compute_planes, (control_args, control), quiet, start_timeout, front, children, stopping
    ):
        yield control


@contextlib.contextmanager
def start_planes(
    computes: list[tuple[list[str], str]],
    control: tuple[list[str], str],
    quiet: bool = False,
    start_timeout: float | None = None,
    front: Front | None = None,
    children: list[subprocess.Popen[bytes]] | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> Iterator[object]:
    """Compute planes and a control plane driving them (`hetero-infer ARGS` and the
    address each serves on); yields once the control plane is serving (a compute plane
    attached) what `front` gave, and stops them all (the front first) at the end.

    One compute plane loads while the control plane starts (both start at once; the
    control plane attaches it as soon as it is serving); several start together, and the
    control plane once they are all serving, so that it attaches them all at once; with
    none, the control plane drives compute planes that are up already.
    `front`: a context entered with the control plane's address as soon as that listens
    (the gateway, which then starts while the compute plane loads).
    start_timeout: seconds for all of them to be serving (TimeoutError, each stopped);
    default: START_TIMEOUT for each. stopping: StartStopped (each stopped) once it turns
    true while they start.
    """
    deadline = None if start_timeout is None else time.monotonic() + start_timeout

    def left() -> float:
        return START_TIMEOUT if deadline is None else max(0.0, deadline - time.monotonic())

    control_args, address = control
    with contextlib.ExitStack() as stack:
        started = [] if children is None else children

        def spawn(args: list[str]) -> subprocess.Popen[bytes]:
            started.append(stack.enter_context(spawned(args, quiet)))
            return started[-1]

        procs = [spawn(args) for args, _ in computes]
        out: list[object] = [None]

        def control_up() -> subprocess.Popen[bytes]:
            proc = spawn(control_args)
            if front is not None:
                wait_serving(address, proc, timeout=left(), listening=True, stopping=stopping)
                out[0] = stack.enter_context(front(address))
            return proc

        proc = control_up() if len(computes) == 1 else None
        for kproc, (_, compute) in zip(procs, computes, strict=True):
            wait_serving(compute, kproc, timeout=left(), stopping=stopping)
        proc = proc or control_up()
        wait_serving(address, proc, timeout=left(), stopping=stopping)
        yield out[0]


def wait_http_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout: float = START_TIMEOUT,
    stopping: Callable[[], bool] = lambda: False,
) -> bool:
    """Wait until `url` answers 200 (True), or `stopping()` turns true first (False)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopping():
            return False
        if proc.poll() is not None:
            raise PlaneExited(proc, "before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def serve_stack(
    model: str,
    host: str,
    port: int,
    compute_args: list[str],
    log_args: tuple[str, ...] = (),
    metrics_ports: tuple[int, int] = (0, 0),
    control_args: tuple[str, ...] = (),
    num_compute: int = 1,
    gateway_args: tuple[str, ...] = (),
) -> int:
    """Run the three planes until SIGINT/SIGTERM; print the URL once the gateway is ready.
    `num_compute`: compute planes behind the control plane (data parallel)."""
    stop = False
    planes: list[subprocess.Popen[bytes]] = []
    gateways: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, frame: object) -> None:
        # The planes, in process groups of their own (`spawned`), all drain at once, as
        # when the terminal's Ctrl-C reached each: SIGTERM, of which one still starting
        # dies quietly; a second Ctrl-C is passed on (the gateway then stops at once).
        nonlocal stop
        again = signal.SIGINT if stop and signum == signal.SIGINT else None
        if again or not stop:
            for proc in (*planes, *gateways):
                if proc.poll() is None:
                    proc.send_signal(again or signal.SIGTERM)
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    @contextlib.contextmanager
    def gateway(control: str) -> Iterator[None]:
        """The gateway, started while the compute plane loads."""
        with gateway_process(control, port, "--host", host, *log_args, *gateway_args) as gw:
            gateways.append(gw)
            yield

    try:
        with local_planes(
            model,
            quiet=False,
            extra_compute=tuple(compute_args),
            metrics_ports=metrics_ports,
            log_args=log_args,
            extra_control=control_args,
            num_compute=num_compute,
            front=gateway,
            children=planes,
            stopping=lambda: stop,
        ):
            gw = gateways[0]
            # A stop signal while the gateway starts is a clean stop too.
            if wait_http_ready(f"http://{host}:{port}/ready", gw, stopping=lambda: stop):
                print(f"hetero-infer serving the OpenAI API at http://{host}:{port}/v1", flush=True)
            # Nothing restarts a plane here: one that ends ends the stack (a dead compute
            # plane left a gateway answering 503 for ever), with an error unless it drained.
            while not stop:
                ended = [p for p in (*planes, gw) if p.poll() is not None]
                if failed := [p for p in ended if p.returncode != 0]:
                    raise PlaneExited(failed[0], "while serving; the others are stopped")
                if ended:
                    break
                time.sleep(0.2)
    except StartStopped:  # Ctrl-C or SIGTERM while the planes start: a clean stop too
        pass
    return 0
