"""Reading one tensor's data from a model's file, or from the shard of a split model holding it.

For the few small tensors forecache reads itself (routers, norms): each is mapped from its file at
its offset and dequantized, without gguf-py's ``GGUFReader`` building a view of every tensor of
one file (and seeing only that file's tensors of a split model).
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from forecache.gguf.header import ModelFile


def tensor_array(model: ModelFile, name: str) -> np.ndarray | None:
    """Tensor ``name`` of ``model`` as float32 in numpy order (``shape`` reversed), read from
    the file holding it; None when the model has no such tensor."""
    t = next((t for t in model.tensors if t.name == name), None)
    if t is None:
        return None
    path, offset = model.locate(t)
    block, size = GGML_QUANT_SIZES[t.type]
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(t.nbytes,))
    rows = raw.reshape(-1, t.shape[0] // block * size)
    return np.ascontiguousarray(dequantize(rows, t.type), np.float32).reshape(
        tuple(reversed(t.shape)))
