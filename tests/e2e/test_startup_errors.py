"""A bad flag or an unusable model stops a plane's process at start-up with one line that
names it and exit status 2: no traceback, nothing left running."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from hetero_common.cpus import usable_cpus
from hetero_common.model_path import gemma3_gguf
from hetero_infer.local import free_port, stop_process
from tests.procs import compute_plane, memory_left


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hetero_infer.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _refused(r: subprocess.CompletedProcess[str], message: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"hetero-infer: error: {message}" in r.stderr, r.stderr


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("plane", ["control-plane", "compute-plane"])
def test_a_port_in_use_is_named(plane: str, taken_port: int) -> None:
    # Both were a RuntimeError / OSError traceback, exit 1.
    extra = ("--model", "/nonexistent") if plane == "compute-plane" else ()  # binds first
    r = _run(plane, "--port", str(taken_port), "--metrics-port", "-1", *extra)
    _refused(r, f"--port {taken_port}: cannot listen on 127.0.0.1:{taken_port}")
    r = _run(plane, "--port", str(free_port()), "--metrics-port", str(taken_port), *extra)
    _refused(r, f"--metrics-port {taken_port}: cannot listen on 127.0.0.1:{taken_port}")


def _truncated(smollm2_path: Path, tmp_path: Path) -> Path:
    """The bundled model cut inside its tokenizer's strings (a failed download)."""
    path = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as f:
        path.write_bytes(f.read(1_000_000))
    return path


@pytest.mark.parametrize("plane", ["control-plane", "compute-plane"])
def test_a_truncated_gguf_is_named(plane: str, smollm2_path: Path, tmp_path: Path) -> None:
    # Was an IndexError traceback in both planes.
    cut = _truncated(smollm2_path, tmp_path)
    r = _run(plane, "--model", str(cut), "--port", str(free_port()), "--metrics-port", "-1")
    _refused(r, f"{cut}: not a readable GGUF file")


def test_a_gguf_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    # The control plane's tokenizer: was a TypeError traceback.
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    r = _run(
        "control-plane", "--model", str(path), "--port", str(free_port()), "--metrics-port", "-1"
    )
    _refused(r, f"{path}: no tokenizer in the GGUF metadata")


def _running(marker: str) -> list[str]:
    """Command lines of this machine's processes that hold `marker`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in args)
        if marker in line and "hetero_infer.cli" in line:
            found.append(line)
    return found


@pytest.mark.parametrize(
    ("flag", "plane", "error"),
    [
        # (known once the model's shape is read: a block of it is 737280 bytes)
        ("--compute-arg=--kv-cache-bytes=1000", "compute plane", "--kv-cache-bytes 1000 holds"),
        ("--control-arg=--max-num-seqs=0", "control plane", "--max-num-seqs must be >= 1"),
    ],
)
def test_serve_stops_when_a_plane_fails_to_start(flag: str, plane: str, error: str) -> None:
    # Was a RuntimeError traceback quoting the plane's whole command line.
    port = free_port()
    r = _run("serve", "--port", str(port), flag)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"hetero-infer: error: {error}" in r.stderr  # the plane's own line
    assert f"hetero-infer: error: the {plane} exited with status 2 before serving" in r.stderr
    assert not _running(f"--port {port}")  # the gateway, stopped with the others


def test_serve_names_a_compute_arg_its_compute_plane_would_refuse_before_starting() -> None:
    # (serve reads the compute plane's flags for its memory check, before any plane starts)
    port = free_port()
    r = _run("serve", "--port", str(port), "--compute-arg=--block-size=0")
    _refused(r, "--block-size must be in 1..256, got 0")
    assert "compute_plane" not in r.stderr  # nothing started


def test_speculation_a_compute_plane_cannot_do_stops_the_control_plane() -> None:
    # It logged an ERROR and served without speculation.
    with compute_plane("--kv-cache-bytes", str(64 << 20)) as compute:
        r = _run(
            "control-plane", "--port", str(free_port()), "--metrics-port", "-1",
            "--compute", compute, "--speculative", "draft",
        )  # fmt: skip
    _refused(r, f"--speculative draft: the compute plane at {compute} holds no draft model")


@pytest.mark.parametrize(
    ("model", "compute_model", "served"),
    [
        ("default", "gemma3", "Gemma 3 270m"),
        ("gemma3", "default", "Smollm2 135M 8k Lc100K Mix1 Ep2"),
    ],
)
def test_a_compute_plane_of_another_vocabulary_stops_the_control_plane(
    model: str, compute_model: str, served: str
) -> None:
    # It attached and served: Gemma 3's weights fed SmolLM2's token ids answered gibberish,
    # SmolLM2's fed Gemma 3's gibberish or a 400 for an id past its vocabulary.
    with compute_plane("--model", compute_model, "--kv-cache-bytes", str(64 << 20)) as compute:
        r = _run(
            "control-plane", "--port", str(free_port()), "--metrics-port", "-1",
            "--compute", compute, "--model", model,
        )  # fmt: skip
    _refused(
        r,
        f"--model {model}: the compute plane at {compute} serves {served}, whose vocabulary "
        "is not this tokenizer's (0 of 48 blocks of 1024 token ids agree)",
    )


def test_serve_refuses_a_bad_port_before_starting_anything() -> None:
    r = _run("serve", "--port", "70000", timeout=30)
    _refused(r, "--port must be in 1..65535, got 70000")
    assert "compute_plane" not in r.stderr  # no plane logged a line


def test_serve_refuses_a_port_in_use_before_starting_anything(taken_port: int) -> None:
    # The gateway found it in use only once the compute plane had loaded its model: 'the
    # gateway exited with status 3 before it was ready: its error is above'. Exit status
    # 1, as a plane that cannot start (a metrics port in use is a usage error, below).
    r = _run("serve", "--port", str(taken_port), timeout=30)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.endswith(
        f"hetero-infer: error: --port {taken_port}: cannot listen on 127.0.0.1:{taken_port}: "
        "Address already in use\n"
    ), r.stderr
    assert "compute_plane" not in r.stderr  # nothing started


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--compute-metrics-port", "70000"), "--compute-metrics-port must be in -1..65535"),
        (("--control-metrics-port", "-2"), "--control-metrics-port must be in -1..65535, got -2"),
        (("--speculative", "ngram", "--num-speculative-tokens", "0"), "--num-speculative-tok"),
        (("--draft-model", "d", "--num-speculative-tokens", "65"), "--num-speculative-tokens m"),
        # SystemExit's message, exit status 1 (a usage error is 2)
        (("--speculative", "draft"), "--speculative draft needs --draft-model PATH"),
        (("--speculative", "ngram", "--draft-model", "d"), "--draft-model is for --speculative"),
    ],
)
def test_serve_refuses_bad_plane_flags_before_starting_anything(
    args: tuple[str, ...], message: str
) -> None:
    # The planes started and loaded, then refused them naming their own flags (--metrics-port,
    # --max-speculative-tokens: not what was typed) in two error lines, exit 1.
    r = _run("serve", "--port", str(free_port()), *args, timeout=30)
    _refused(r, message)
    assert "compute_plane" not in r.stderr  # nothing started


@pytest.mark.parametrize("planes", [1, 2])
def test_serve_refuses_a_metrics_port_in_use_before_starting_anything(
    planes: int, taken_port: int
) -> None:
    # Compute plane i's /metrics is --compute-metrics-port + i; one taken stopped the
    # stack once the others had loaded, naming the plane's own --metrics-port.
    if usable_cpus() < planes:
        pytest.skip(f"--compute-planes {planes} needs {planes} CPUs")
    first = taken_port - planes + 1
    args = ("--compute-planes", str(planes), "--compute-metrics-port", str(first))
    r = _run("serve", "--port", str(free_port()), *args, timeout=30)
    name = "--compute-metrics-port + 1 (compute plane 2's)" if planes == 2 else args[2]
    _refused(r, f"{name}: port {taken_port} is not free")
    assert "compute_plane" not in r.stderr  # nothing started


def test_serve_refuses_metrics_ports_that_meet_before_starting_anything() -> None:
    if usable_cpus() < 2:
        pytest.skip("--compute-planes 2 needs 2 CPUs")
    port = free_port()
    args = ("--compute-planes", "2", "--compute-metrics-port", str(port))
    r = _run("serve", "--port", str(free_port()), *args, "--control-metrics-port", str(port + 1))
    _refused(r, f"--control-metrics-port is port {port + 1}, as --compute-metrics-port + 1")
    assert "compute_plane" not in r.stderr  # nothing started


@pytest.mark.parametrize("extra", [0, 1])
def test_serve_bounds_compute_planes_by_the_cpus(extra: int) -> None:
    # No upper bound: --compute-planes 10000 started 10000 processes, each loading the model.
    cpus = usable_cpus()
    n = 0 if extra == 0 else cpus + extra
    r = _run("serve", "--port", str(free_port()), "--compute-planes", str(n), timeout=30)
    _refused(r, f"--compute-planes must be in 1..{cpus}, got {n}: each compute plane takes")
    assert "compute_plane" not in r.stderr  # nothing started


def test_generate_names_why_its_quiet_plane_failed(tmp_path: Path) -> None:
    # generate hides the planes' output: all it said was the command line and status 2.
    r = _run("generate", "hi", "--model", str(tmp_path / "missing"))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith(
        f"exited with status 2 before serving: model path does not exist: {tmp_path}/missing"
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        # libgomp's complaint and a RuntimeError traceback from torch.set_num_threads.
        ("--num-threads=-3", "--num-threads must be >= 1, got -3"),
        # mmap's OSError (ENOMEM) traceback: more than the kernel will map.
        ("--kv-cache-bytes=100000000000000000", "--kv-cache-bytes 100000000000000000 ("),
        # Named the field (kv_cache_bytes=1000): 2 x 30 layers x 16 x 3 KV heads x 64 x 4 B.
        ("--kv-cache-bytes=1000", "--kv-cache-bytes 1000 holds 0 block(s) of 737280 bytes;"),
    ],
)
def test_compute_plane_sizes_it_cannot_have_are_named(flag: str, message: str) -> None:
    r = _run("compute-plane", "--port", str(free_port()), "--metrics-port", "-1", flag)
    _refused(r, message)


def test_a_kv_cache_larger_than_the_memory_available_is_refused() -> None:
    # As large as the machine's RAM: the lazily mapped pool was accepted (each layer's
    # tensor maps), and the OOM killer ended the plane once the cache filled.
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    flag = f"--kv-cache-bytes={total}"
    r = _run("compute-plane", "--port", str(free_port()), "--metrics-port", "-1", flag)
    _refused(r, f"--kv-cache-bytes {total} (")
    assert "is more than the memory available" in r.stderr


def test_serve_counts_the_weights_of_its_compute_planes_before_starting_them() -> None:
    # Only N x --kv-cache-bytes was checked: each plane's weights were not counted, so a
    # serve whose planes could not all hold them with their caches started and loaded.
    if usable_cpus() < 2:
        pytest.skip("--compute-planes 2 needs 2 CPUs")
    weights = os.path.getsize(gemma3_gguf())  # (the file the planes would load)
    available = memory_left()
    # 2 x the cache alone is `weights` short of the memory available, 2 x (cache + the
    # weights) `weights` past it: a margin of the weights either way for what the machine
    # does meanwhile.
    kv = (available - weights) // 2
    args = ("--model", "gemma3", "--compute-planes", "2", f"--compute-arg=--kv-cache-bytes={kv}")
    r = _run("serve", "--port", str(free_port()), *args, timeout=60)
    _refused(r, f"--compute-planes 2 x (--kv-cache-bytes {kv} (")
    assert f" + the weights, ~{weights} bytes (" in r.stderr, r.stderr
    assert "the model files' size, an estimate" in r.stderr, r.stderr
    assert "compute_plane" not in r.stderr  # nothing started


@pytest.mark.parametrize("command", ["compute-plane", "serve"])
def test_one_compute_planes_weights_count_against_the_memory_before_they_load(
    command: str,
) -> None:
    # One compute plane checked only its KV cache, once its weights were in (serve checked
    # the weights only for --compute-planes > 1): weights too big for the machine met the
    # OOM killer part way through loading. The cache here leaves a quarter of the weights
    # free; with the weights it is three quarters past (a margin for the machine's drift).
    weights = os.path.getsize(gemma3_gguf())
    available = memory_left()
    kv = available - weights // 4
    port = ("--port", str(free_port()))
    if command == "serve":
        r = _run("serve", *port, "--model", "gemma3", f"--compute-arg=--kv-cache-bytes={kv}")
        assert "compute_plane" not in r.stderr  # refused before any plane started
    else:
        args = ("--metrics-port", "-1", "--model", "gemma3", "--kv-cache-bytes", str(kv))
        r = _run("compute-plane", *port, *args)
    _refused(r, f"--kv-cache-bytes {kv} (")
    # (the check after loading counts the cache alone: the weights are in memory by then)
    assert f" + the weights, ~{weights} bytes (" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("template", "message"),
    [
        # Was accepted: every chat request then failed with a 400 blaming the client.
        ("{% if %}", "the chat template does not compile"),
        (None, "cannot read it: [Errno 21] Is a directory"),  # was an IsADirectoryError traceback
        (b"\xff\xfe", "cannot read it: 'utf-8' codec can't decode"),
    ],
)
def test_a_chat_template_that_cannot_serve_stops_the_control_plane(
    template: str | bytes | None, message: str, tmp_path: Path
) -> None:
    path = tmp_path / "t.jinja"
    if template is None:
        path.mkdir()
    elif isinstance(template, bytes):
        path.write_bytes(template)
    else:
        path.write_text(template)
    r = _run(
        "control-plane", "--port", str(free_port()), "--metrics-port", "-1",
        "--chat-template", str(path),
    )  # fmt: skip
    _refused(r, f"--chat-template {path}: {message}")


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of `pid`'s child processes."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                out[int(stat.parent.name)] = cmd.decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_serve_stops_when_a_plane_dies_while_serving() -> None:
    # serve watched only the gateway: with its compute plane gone it kept running, /ready
    # 503 for ever (nothing restarts a plane under serve), and exited 0 when stopped.
    cmd = [sys.executable, "-m", "hetero_infer.cli", "serve", "--port", str(free_port())]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        assert "serving the OpenAI API" in serve.stdout.readline()
        children = _children(serve.pid)
        assert len(children) == 3, children
        (compute,) = [pid for pid, cmd in children.items() if "compute-plane" in cmd]
        os.kill(compute, signal.SIGKILL)
        _, err = serve.communicate(timeout=60)
    finally:
        stop_process(serve)  # type: ignore[arg-type]
    assert serve.returncode == 1, err
    assert "Traceback" not in err, err
    assert (
        "hetero-infer: error: the compute plane was killed by SIGKILL while serving; "
        "the others are stopped"
    ) in err
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]  # all reaped


def test_generate_names_a_refused_request() -> None:
    # The control plane's INVALID_ARGUMENT was a grpc traceback.
    r = _run("generate", "hi", "--max-tokens", "100000000")
    _refused(r, "prompt (1 tokens) + max_tokens (100000000) = 100000001 exceeds")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_serve_takes_its_planes_with_it() -> None:
    # SIGKILL on serve (the OOM killer, kill -9) left its three planes running, holding
    # their ports: nothing told them their parent was gone.
    cmd = [sys.executable, "-m", "hetero_infer.cli", "serve", "--port", str(free_port())]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: dict[int, str] = {}
    try:
        assert serve.stdout is not None
        assert "serving the OpenAI API" in serve.stdout.readline()
        children = _children(serve.pid)
        assert len(children) == 3, children
        serve.kill()
        serve.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [cmd for pid, cmd in children.items() if _alive(pid)]
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_while_serve_starts_stops_it_cleanly() -> None:
    # The terminal's SIGINT went to the planes too: a plane still importing printed a
    # KeyboardInterrupt traceback, one loading its model exited 130, and serve reported
    # "error: the compute plane exited with status 130 before serving", exit 1. serve also
    # waited for every plane to be serving before it looked at the signal.
    port = free_port()
    cmd = [sys.executable, "-m", "hetero_infer.cli", "serve", "--port", str(port)]
    serve = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    children: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 30
        while not children and time.monotonic() < deadline:  # the compute plane, starting
            children = _children(serve.pid)
            time.sleep(0.01)
        assert children
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C
        out, err = serve.communicate(timeout=60)
    finally:
        stop_process(serve)  # type: ignore[arg-type]
    assert serve.returncode == 0, err
    assert "Traceback" not in err, err
    assert "hetero-infer: error" not in err, err
    assert "serving the OpenAI API" not in out
    assert not _running(f"--port {port}")


# Sends this process SIGINT (a Ctrl-C) as it first imports the module $INTERRUPT_AT,
# and writes $INTERRUPTED: an interrupt at one exact point of start-up.
_INTERRUPTER = """
import importlib.abc, os, signal, sys

class Interrupter(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["INTERRUPT_AT"]:
            sys.meta_path.remove(self)
            open(os.environ["INTERRUPTED"], "w").close()
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupter())
"""


@pytest.mark.parametrize(
    "entry",
    [
        ["-m", "hetero_infer.cli"],  # how tests and serve start it
        ["-c", "import sys; from hetero_infer.cli import main; sys.exit(main())"],  # the script
    ],
    ids=["module", "script"],
)
@pytest.mark.parametrize(
    "module",
    [
        "asyncio",  # the standard library, at the top of the subcommands' module
        "grpc",  # a dependency (hetero_infer.local)
        "control_plane.config",  # the parser's (build_parser)
    ],
)
def test_ctrl_c_while_hetero_infer_imports_exits_130_quietly(
    entry: list[str], module: str, tmp_path: Path, ctrl_c_delivered: None
) -> None:
    # A KeyboardInterrupt traceback from the import it hit, and exit status -2 (the
    # interpreter's own SIGINT death): serve's Ctrl-C handling began only once its modules
    # had loaded, ~0.1 s after it started.
    (tmp_path / "sitecustomize.py").write_text(_INTERRUPTER)
    marker = tmp_path / "interrupted"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "INTERRUPT_AT": module, "INTERRUPTED": str(marker)}
    cmd = [sys.executable, *entry, "serve", "--port", str(free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert marker.exists()  # (the interrupt came, during that import)
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr
    assert "compute_plane" not in r.stderr  # nothing started


def test_serve_refuses_compute_planes_whose_kv_caches_together_pass_the_memory() -> None:
    # Each of two planes' caches fits alone (0.6 of MemAvailable): each plane's own check
    # passed, both served, and the OOM killer came once the caches filled.
    available = memory_left()
    each = int(available * 0.6)
    r = _run(
        "serve",
        "--port",
        str(free_port()),
        "--compute-planes",
        "2",
        f"--compute-arg=--kv-cache-bytes={each}",
        timeout=60,
    )
    _refused(r, f"--compute-planes 2 x (--kv-cache-bytes {each} (")  # (+ the weights)
    assert "lower --kv-cache-bytes or --compute-planes" in r.stderr, r.stderr
    assert "compute plane listening" not in r.stderr  # (refused before any started)
