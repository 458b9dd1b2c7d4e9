"""The compute planes' addresses from `--compute`: a list, host names, or a file.

    127.0.0.1:50052,127.0.0.1:50053   two compute planes
    hetero-compute:50052              every address the name resolves to (a Kubernetes
                                      headless Service: one per ready pod)
    file:/etc/hetero/compute.txt      the HOST:PORT lines of a file (# comments)

Names and files are read again while the control plane runs (ControlEngine re-resolves
every `compute_resolve_interval` seconds): an address that appears is a compute plane
that joins, one that disappears leaves (its requests move to the others).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from pathlib import Path

log = logging.getLogger(__name__)


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port); ValueError names a malformed one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a HOST:PORT address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _format(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def targets(spec: str) -> list[str]:
    """The entries of a `--compute` value, files read (ValueError for a malformed one)."""
    out: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item.startswith("file:"):
            path = Path(item[len("file:") :])
            try:
                lines = path.read_text().splitlines()
            except OSError as e:
                log.warning("compute planes file %s: %s", path, e)
                continue
            for line in lines:
                line = line.split("#", 1)[0].strip()
                if line:
                    split_address(line)
                    out.append(line)
        else:
            split_address(item)
            out.append(item)
    return out


def is_static(spec: str) -> bool:
    """Whether `spec` names only IP addresses (nothing to re-resolve)."""
    if "file:" in spec:
        return False
    return all(_is_ip(split_address(a)[0]) for a in targets(spec))


async def resolve(spec: str) -> dict[str, str]:
    """Every compute plane address `spec` stands for now, in order, without repeats, each
    with the host name it came from (the name TLS verifies the server by).

    An IP address stays as written. A host name gives its IPv4 addresses (its IPv6 ones
    where it has no IPv4 address: `localhost` is one compute plane, not two); one that
    does not resolve now gives none (a headless Service with no ready pod).
    """
    loop = asyncio.get_running_loop()
    out: dict[str, str] = {}
    for entry in targets(spec):
        host, port = split_address(entry)
        if _is_ip(host):
            found = [_format(host, port)]
        else:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("compute plane name %s does not resolve: %s", host, e)
                continue
            v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
            v6 = [i[4][0] for i in infos if i[0] == socket.AF_INET6]
            found = [_format(str(ip), port) for ip in dict.fromkeys(v4 or v6)]
        for address in found:
            out.setdefault(address, host)
    return out
