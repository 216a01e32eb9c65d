"""What every reader of a GGUF here shares: its error and llama.cpp's name for expert tensors.

Apart from header.py (which reads headers) and checks.py (which refuses bad ones) so that both
use them without importing each other.
"""

from __future__ import annotations


class GGUFError(ValueError):
    """The file is not a model forecache can run; the message says why and what to do."""


EXPERT_TENSOR_SUFFIX = "_exps.weight"
#: The same test as a tensor buffer-type override pattern (llama.cpp matches it with regex_search).
EXPERT_TENSOR_PATTERN = r"_exps\.weight$"


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is a layer's routed-expert weights, as llama.cpp names them."""
    return name.startswith("blk.") and name.endswith(EXPERT_TENSOR_SUFFIX)
