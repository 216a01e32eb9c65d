"""Shared fixtures: tiny models written once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model(qtype) -> path of the `tiny` preset in that type (seed 0), made on first use."""
    from forecache.model_maker import make_model

    root = tmp_path_factory.mktemp("tiny")
    made: dict[str, Path] = {}

    def get(qtype: str = "q8_0") -> Path:
        if qtype not in made:
            path = root / f"tiny-{qtype}.gguf"
            make_model(path, "tiny", qtype, seed=0, workers=1)
            made[qtype] = path
        return made[qtype]

    return get
