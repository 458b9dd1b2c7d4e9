"""Map a config dataclass onto argparse flags and a JSON config file.

Each plane has one config dataclass (one source of defaults). Fields become
`--field-name` flags (help from `field.metadata["help"]`); `--config FILE` reads a
JSON object whose keys are field names. Precedence: flags > JSON file > defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from hetero_common.model_path import ModelFileError, read_json_object

T = TypeVar("T")


def _base_type(tp: Any) -> Any:
    """`int | None` -> int; `bool` -> bool."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()
) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif typing.get_origin(tp) in (list, tuple):
            (item,) = typing.get_args(tp)[:1]
            parser.add_argument(
                flag, dest=f.name, type=item, nargs="+", default=None, help=help_text
            )
        else:
            conv = tp if tp in (int, float, str) else str
            parser.add_argument(flag, dest=f.name, type=conv, default=None, help=help_text)
    parser.add_argument("--config", type=Path, default=None, help="JSON file of config fields")


def _file_value(path: Path, name: str, value: Any, tp: Any) -> Any:
    """A config file's `value` for a field of type `tp`, as the flag would have given it
    (ValueError naming the file and the field otherwise): JSON has no int/float/bool
    distinction a dataclass would check, and a string "false" is truthy."""
    optional = tp is not _base_type(tp)
    base = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{path}: {name} must not be null")
    if base is bool:
        ok, want = isinstance(value, bool), "true or false"
    elif base is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif base is float:
        ok, want = isinstance(value, int | float) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif base is str:
        ok, want = isinstance(value, str), "a string"
    else:  # no such field yet: left to the dataclass
        ok, want = True, ""
    if not ok:
        raise ValueError(f"{path}: {name} must be {want}, got {json.dumps(value)}")
    return value


def _read_file(path: Path, cls: type) -> dict[str, Any]:
    """The fields a JSON config file sets, each checked against its type."""
    try:
        data = read_json_object(path)
    except ModelFileError as e:  # (it names the file)
        raise ValueError(f"--config {e}") from None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{path}: unknown config fields {unknown}; known: {sorted(names)}")
    return {k: _file_value(path, k, v, hints[k]) for k, v in data.items()}


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build `cls` from JSON file values, then flags that were given, then overrides."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    if getattr(args, "config", None) is not None:
        values.update(_read_file(Path(args.config), cls))
    from_file = set(values)
    for name in names:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
            from_file.discard(name)
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as e:  # the operator typed flags: name them, not the fields
        raise ValueError(as_flags(str(e), names - from_file - set(overrides))) from None


def as_flags(message: str, names: set[str]) -> str:
    """A config check's `message` with the field names in `names` written as their flags
    (`block_size must be ...` -> `--block-size must be ...`); the value after ", got " is
    left as given, and a name already in a flag (`--tls-cert`) is left alone."""
    head, sep, tail = message.partition(", got ")
    for name in sorted(names, key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        head = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", flag, head)
    return head + sep + tail
