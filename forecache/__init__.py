"""forecache: run Mixture-of-Experts GGUF models larger than GPU memory on llama.cpp.

``forecache.Llama`` is a drop-in for ``llama_cpp.Llama`` (see forecache.llama).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Llama", "__version__"]


def __getattr__(name: str) -> Any:
    # imported on first use: the command line starts without loading llama.cpp
    if name == "Llama":
        from forecache.llama import Llama

        return Llama
    raise AttributeError(f"module 'forecache' has no attribute {name!r}")
