"""forecache: run Mixture-of-Experts GGUF models larger than GPU memory on llama.cpp.

``forecache.Llama`` is a drop-in for ``llama_cpp.Llama`` (see forecache.llama).
"""

from __future__ import annotations

from forecache.version import __version__

# typing for type checkers only: it takes about 10 ms to import, and the command line takes
# over Ctrl-C only after this package is imported
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["Llama", "__version__"]


def __getattr__(name: str) -> Any:
    # imported on first use: the command line starts without loading llama.cpp
    if name == "Llama":
        from forecache.llama import Llama

        return Llama
    raise AttributeError(f"module 'forecache' has no attribute {name!r}")
