"""Addresses of a plane's peers from a flag: a list, host names, or a file.

    127.0.0.1:50052,127.0.0.1:50053   two planes
    hetero-compute:50052              every address the name resolves to (a Kubernetes
                                      headless Service: one per ready pod)
    file:/etc/hetero/compute.txt      the HOST:PORT lines of a file (# comments)

The control plane's `--compute` and the gateway's `--control` read this way. Names and
files are read again while the process runs (every `--compute-resolve-interval` /
`--control-resolve-interval` seconds): an address that appears is a plane that joins,
one that disappears leaves.
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


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _file_entries(path: Path) -> list[tuple[str, int]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        log.warning("address file %s: %s", path, e)
        return []
    out = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(split_address(line))
    return out


def targets(spec: str) -> list[tuple[str, int]]:
    """The (host, port) entries of a flag's value, files read (ValueError for a malformed
    entry, or a value with neither an address nor a file)."""
    out: list[tuple[str, int]] = []
    files = False
    for item in (s.strip() for s in spec.split(",")):
        if item.startswith("file:"):
            files = True
            out += _file_entries(Path(item[len("file:") :]))
        elif item:
            out.append(split_address(item))
    if not out and not files:
        raise ValueError(f"no HOST:PORT address in {spec!r}")
    return out


def static_addresses(spec: str) -> dict[str, str] | None:
    """The addresses of a value of IP addresses only (each its own host), or None when
    it names a host or a file (to be resolved, and again later)."""
    if any(s.strip().startswith("file:") for s in spec.split(",")):
        return None
    entries = targets(spec)
    if not all(is_ip(host) for host, _ in entries):
        return None
    return {join_address(host, port): host for host, port in entries}


async def resolve(spec: str) -> dict[str, str] | None:
    """Every address `spec` stands for now, in order, without repeats, each with the host
    name it came from (the name TLS verifies the server by); None when a name could not
    be looked up at all (a resolver failure: keep what was known).

    An IP address stays as written. A host name gives its IPv4 addresses (its IPv6 ones
    where it has none: `localhost` is one plane, not two); a name that does not exist
    gives none (a headless Service with no ready pod).
    """
    loop = asyncio.get_running_loop()
    out: dict[str, str] = {}
    for host, port in targets(spec):
        if is_ip(host):
            out.setdefault(join_address(host, port), host)
            continue
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
                log.warning("name %s: lookup failed: %s", host, e)
                return None
            log.warning("name %s does not resolve: %s", host, e)
            continue
        except OSError as e:
            log.warning("name %s: lookup failed: %s", host, e)
            return None
        v4 = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET]
        v6 = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET6]
        for ip in dict.fromkeys(v4 or v6):
            out.setdefault(join_address(ip, port), host)
    return out
