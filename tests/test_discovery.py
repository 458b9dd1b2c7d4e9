"""Peer addresses from a flag (hetero_common.discovery): lists, host names, files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hetero_common.discovery import resolve, split_address, static_addresses, targets


def test_split_address() -> None:
    assert split_address("127.0.0.1:50052") == ("127.0.0.1", 50052)
    assert split_address("[::1]:7") == ("::1", 7)
    assert split_address("hetero-compute:50052") == ("hetero-compute", 50052)
    for bad in ("hetero-compute", ":50052", "host:port", "host:0", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_address(bad)


def test_lists_files_and_names(tmp_path: Path) -> None:
    listing = tmp_path / "planes.txt"
    listing.write_text("# compute planes\n10.0.0.2:50052\n\n10.0.0.3:50052  # the second\n")
    spec = f"127.0.0.1:1, file:{listing} ,localhost:2,127.0.0.1:1"
    assert targets(spec) == [
        ("127.0.0.1", 1),
        ("10.0.0.2", 50052),
        ("10.0.0.3", 50052),
        ("localhost", 2),
        ("127.0.0.1", 1),
    ]
    resolved = asyncio.run(resolve(spec))
    assert resolved is not None
    # In order, without repeats; localhost is one plane (its IPv4 address), TLS name kept.
    assert list(resolved) == ["127.0.0.1:1", "10.0.0.2:50052", "10.0.0.3:50052", "127.0.0.1:2"]
    assert resolved["127.0.0.1:2"] == "localhost"
    assert resolved["10.0.0.2:50052"] == "10.0.0.2"
    assert static_addresses("127.0.0.1:1,[::1]:2") == {"127.0.0.1:1": "127.0.0.1", "[::1]:2": "::1"}
    assert static_addresses("127.0.0.1:1,localhost:2") is None
    assert static_addresses(f"file:{listing}") is None  # read again later


def test_missing_files_and_malformed_entries(tmp_path: Path) -> None:
    spec = f"file:{tmp_path / 'missing.txt'},127.0.0.1:3"
    assert asyncio.run(resolve(spec)) == {"127.0.0.1:3": "127.0.0.1"}
    assert targets(f"file:{tmp_path / 'missing.txt'}") == []  # planes may join later
    bad = tmp_path / "bad.txt"
    bad.write_text("not-an-address\n")
    with pytest.raises(ValueError, match="not-an-address"):
        targets(f"file:{bad}")
    with pytest.raises(ValueError, match="no HOST:PORT"):
        targets(" , ")
