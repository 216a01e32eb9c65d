"""The built-in default model: made on first use so the main command works out of the box."""

from __future__ import annotations

import sys
from pathlib import Path

from forecache.paths import cache_dir

# The trained reference model shipped in the package (tools/reference_model); when a checkout
# lacks it, a random-weight `tiny` is made instead so the main command still runs.
REFERENCE_MODEL = (Path(__file__).resolve().parents[1] / "data" / "models" /
                   "forecache-ref-q8_0.gguf")
# its dense draft for speculative decoding (`--draft`), trained by the same recipe: same
# vocabulary, width and depth
REFERENCE_DRAFT = REFERENCE_MODEL.with_name("forecache-ref-draft-q8_0.gguf")
DEFAULT_PRESET = "tiny"
DEFAULT_TYPE = "q8_0"
DEFAULT_SEED = 0
DEFAULT_PROMPT = "Continue this text:\nAnd it came to pass, when the king"


def default_model_path() -> Path:
    """Where the default model lives in the user's cache."""
    return cache_dir() / "models" / f"{DEFAULT_PRESET}-{DEFAULT_TYPE}-seed{DEFAULT_SEED}.gguf"


def ensure_default_model() -> Path:
    """The default model's path: the shipped reference model, else a `tiny` made on first use."""
    return REFERENCE_MODEL if REFERENCE_MODEL.is_file() else ensure_tiny_model()


def ensure_tiny_model() -> Path:
    """The random-weight `tiny` model, made in the cache on first use."""
    path = default_model_path()
    if not path.exists():
        from forecache.gguf.maker import make_model

        print(f"forecache: making the default model ({DEFAULT_PRESET}, {DEFAULT_TYPE}) at {path}",
              file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(path, DEFAULT_PRESET, DEFAULT_TYPE, seed=DEFAULT_SEED)
    return path
