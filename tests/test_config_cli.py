"""Config dataclasses <-> CLI flags and JSON config files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from control_plane.config import ControlConfig
from hetero_infer.cli import build_parser
from hetero_infer.config_cli import add_dataclass_arguments, config_from_args


def _parse(cls: type, argv: list[str]):  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    add_dataclass_arguments(p, cls)
    return config_from_args(cls, p.parse_args(argv))


def test_flags_file_and_defaults(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(
        json.dumps({"max_num_seqs": 8, "max_model_len": 512, "enable_prefix_caching": False})
    )
    cfg = _parse(ControlConfig, ["--config", str(f), "--max-num-seqs", "4"])
    assert cfg.max_num_seqs == 4  # the flag beats the file
    assert cfg.max_model_len == 512 and cfg.enable_prefix_caching is False  # from the file
    assert cfg.max_num_batched_tokens == ControlConfig().max_num_batched_tokens  # default
    assert _parse(ControlConfig, ["--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_unknown_field_in_file_is_named(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"block_size": 32}))
    assert _parse(ComputeConfig, ["--config", str(f)]).block_size == 32
    f.write_text(json.dumps({"block_size": 16, "max_num_blocks": 100}))
    with pytest.raises(ValueError, match="max_num_blocks"):
        _parse(ComputeConfig, ["--config", str(f)])  # a control-plane field, not a compute one


def test_invalid_values_are_refused() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        ControlConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        ComputeConfig(dtype="int3")


def test_every_subcommand_parses() -> None:
    parser = build_parser()
    for argv in (
        ["compute-plane", "--kv-cache-bytes", "1000000", "--block-size", "32"],
        ["control-plane", "--compute", "h:1", "--max-num-blocks", "64"],
        ["gateway", "--control", "h:2", "--port", "9000"],
        ["serve", "--port", "9001"],
        ["generate", "hi", "--max-tokens", "3"],
    ):
        assert parser.parse_args(argv).command == argv[0]
