"""hetero_infer.local.free_port: the ports the local stacks give their planes."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import pytest

from hetero_infer import local


def test_ports_are_outside_the_ephemeral_range_distinct_and_free() -> None:
    low, high = local._ephemeral_range()
    ports = [local.free_port() for _ in range(100)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert not low <= port <= high  # bind(0) and outgoing connections never get it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", local.free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        later = local.free_port()
        picks: Iterator[int] = iter([busy, busy, later])
        monkeypatch.setattr(random.SystemRandom, "randint", lambda self, a, b: next(picks))
        local._handed_out.discard(later)
        assert local.free_port() == later


def test_no_room_outside_the_range_lets_the_kernel_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_ephemeral_range", lambda: (1024, 65535))
    port = local.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_stopped_plane_is_given_its_whole_drain_before_it_is_killed() -> None:
    """serve stops each plane with SIGTERM and kills it only after STOP_TIMEOUT: longer
    than a plane's default drain, or Ctrl-C on serve cut the streams a plane was still
    finishing (it killed them after 15 s of a 30 s drain)."""
    import dataclasses

    from hetero_common.server_config import ServerConfig

    drain = {f.name: f.default for f in dataclasses.fields(ServerConfig)}["drain_timeout"]
    assert drain < local.STOP_TIMEOUT


def test_listener_listens_and_names_a_port_in_use() -> None:
    """The one check behind serve's --port (check_ports) and its metrics ports: a port
    another socket listens on is EADDRINUSE; a free one accepts a connection until the
    listener is closed, after which it binds again."""
    import errno

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(OSError) as e:
            local.listener("127.0.0.1", busy)
        assert e.value.errno == errno.EADDRINUSE
    port = local.free_port()
    with local.listener("127.0.0.1", port), socket.create_connection(("127.0.0.1", port)):
        pass
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))
