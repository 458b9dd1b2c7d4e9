"""Config dataclasses <-> CLI flags and JSON config files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from control_plane.config import ControlConfig
from gateway.config import GatewayConfig
from hetero_infer.cli import main
from hetero_infer.commands import build_parser
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


@pytest.mark.parametrize(
    ("cls", "data", "message"),
    [
        (ComputeConfig, {"block_size": "16"}, r"block_size must be an integer, got \"16\""),
        (ComputeConfig, {"block_size": 16.5}, "block_size must be an integer, got 16.5"),
        (ComputeConfig, {"block_size": True}, "block_size must be an integer, got true"),
        (ComputeConfig, {"block_size": None}, "block_size must not be null"),
        (ComputeConfig, {"cuda_graphs": "false"}, r"cuda_graphs must be true or false"),
        (ComputeConfig, {"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a n"),
        (ControlConfig, {"compute": 5}, "compute must be a string, got 5"),
        (ControlConfig, {"max_num_seqs": [64]}, r"max_num_seqs must be an integer, got \[64\]"),
    ],
)
def test_wrongly_typed_file_values_are_named(
    tmp_path: Path, cls: type, data: dict[str, object], message: str
) -> None:
    # Each was a TypeError/AttributeError traceback, or (a string "false") taken as true.
    f = tmp_path / "c.json"
    f.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"c\.json: {message}"):
        _parse(cls, ["--config", str(f)])


def test_a_refused_value_names_the_flag_it_came_from(tmp_path: Path) -> None:
    # Start-up errors named the field (block_size), not the flag the operator typed.
    with pytest.raises(ValueError, match=r"^--block-size must be in 1\.\.256, got 0$"):
        _parse(ComputeConfig, ["--block-size", "0"])
    with pytest.raises(ValueError, match=r"^--max-num-batched-tokens and --max-num-seqs must"):
        _parse(ComputeConfig, ["--max-num-seqs", "0"])
    with pytest.raises(ValueError, match=r"^--device must be .*, got 'port'$"):  # (as given)
        _parse(ComputeConfig, ["--device", "port"])
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"block_size": 0}))
    with pytest.raises(ValueError, match=r"^block_size must be"):  # the file's key
        _parse(ComputeConfig, ["--config", str(f)])
    with pytest.raises(ValueError, match=r"^--block-size must be"):  # the flag beats the file
        _parse(ComputeConfig, ["--config", str(f), "--block-size", "300"])


def test_file_values_of_the_right_type_are_taken(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(
        json.dumps({"max_model_len": None, "gpu_memory_utilization": 1, "dtype": "float32"})
    )
    cfg = _parse(ComputeConfig, ["--config", str(f)])
    assert cfg.max_model_len is None and cfg.dtype == "float32"
    assert cfg.gpu_memory_utilization == 1.0 and isinstance(cfg.gpu_memory_utilization, float)


def test_unreadable_config_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text('{"block_size": ')
    for path in (tmp_path / "c.json", tmp_path, tmp_path / "missing.json"):
        with pytest.raises(ValueError, match=rf"--config {path}"):
            _parse(ComputeConfig, ["--config", str(path)])


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        # 0 re-read a file or DNS name of compute planes in a busy loop (a core at 92 %).
        (ControlConfig, "compute_resolve_interval", 0.0),
        (ControlConfig, "compute_resolve_interval", float("nan")),
        (ControlConfig, "max_compute_planes", -1),  # attached no compute plane at all
        (ControlConfig, "compute_timeout", -5.0),
        (ControlConfig, "route_load_slack", -1),
        (ControlConfig, "drain_timeout", float("nan")),  # NaN passed "< 0" checks
        (GatewayConfig, "control_retry_timeout", float("nan")),
        (GatewayConfig, "drain_timeout", float("nan")),
    ],
)
def test_values_that_were_taken_and_misbehaved_are_refused(
    cls: type, field: str, value: float
) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be >"):
        cls(**{field: value})


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


@pytest.mark.parametrize(
    ("argv", "level"),
    [(["--log-level", "BOGUS", "generate", "hi"], "BOGUS"), (["gateway", "--log-level", "x"], "x")],
)
def test_an_unknown_log_level_is_a_usage_error(
    argv: list[str], level: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was logging's ValueError traceback (exit 1) once the command ran.
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].endswith(
        f"error: argument --log-level: invalid level {level!r} "
        "(DEBUG, INFO, WARNING, ERROR or CRITICAL)"
    )
    assert build_parser().parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "argument --seed: must be in 0..18446744073709551615, got -1"),
        (["--seed", str(2**64)], f"argument --seed: must be in 0..{2**64 - 1}, got {2**64}"),
        (["--max-tokens", str(2**31)], f"--max-tokens: must be in 0..2147483647, got {2**31}"),
        (["--max-tokens", "-5"], "argument --max-tokens: must be in 0..2147483647, got -5"),
        (["--temperature", "-1"], "argument --temperature: must be in [0, 2], got -1"),
        (["--temperature", "nan"], "argument --temperature: must be in [0, 2], got nan"),
        (["--temperature", "2.5"], "argument --temperature: must be in [0, 2], got 2.5"),
    ],
)
def test_generate_flags_the_request_cannot_hold_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each started both planes, then protobuf's ValueError 'Value out of range: -1' (or the
    # control plane's 'max_tokens and min_tokens must be >= 0') named no flag.
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "hi", *argv])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)


def test_a_generate_prompt_that_is_not_utf8_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Bytes that are not UTF-8 reach argv as surrogates; protobuf refused them with
    # "'utf-8' codec can't encode characters in position 0-1" naming no argument.
    prompt = b"\xff\xfe hi".decode(errors="surrogateescape")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", prompt])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("error: argument prompt: is not valid UTF-8")
    )
    with pytest.raises(SystemExit) as exit_:  # (the control plane's refusal, planes loaded)
        build_parser().parse_args(["generate", ""])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: argument prompt: is empty")
    args = build_parser().parse_args(["generate", "héllo", "--seed", str(2**64 - 1)])
    assert (args.prompt, args.seed, args.max_tokens) == ("héllo", 2**64 - 1, 64)
