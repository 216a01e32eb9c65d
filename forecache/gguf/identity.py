"""Which model a trace or a trained predictor belongs to: a content fingerprint plus the shape.

Hashing a 32 GB GGUF on every start would cost a minute, so the fingerprint covers the whole header
(metadata and tensor table) and 4 KiB at four places in every tensor; any two different models (a
retrained or requantized one included) differ there. It is cached by (path, size, mtime, inode).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import Any

from forecache.gguf.header import ModelFile
from forecache.paths import cache_dir, write_atomic

_SAMPLE = 4096
_PAGE = mmap.PAGESIZE
FINGERPRINT_VERSION = 1


class ModelMismatchError(ValueError):
    """A trace or predictor was made for another model; the message says which and what to do."""


def fingerprint(model: ModelFile) -> str:
    """sha256 over the GGUF header and samples of every tensor's bytes (cached per file)."""
    st = model.path.stat()
    key = f"{model.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{FINGERPRINT_VERSION}"
    memo = cache_dir() / "fingerprints" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".txt")
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    with open(model.path, "rb", buffering=0) as f:
        h.update(f.read(model.data_offset))
        # no readahead around the samples, and none of them left in the page cache: a model
        # larger than host memory has no room for them (its disk tier reads experts itself)
        _advise(f.fileno(), 0, 0, "POSIX_FADV_RANDOM")
        for t in sorted(model.tensors, key=lambda t: t.offset):
            start = model.data_offset + t.offset
            for frac in (0, 1, 2, 3):
                off = start + max(0, (t.nbytes - _SAMPLE) * frac // 3)
                n = min(_SAMPLE, t.nbytes)
                f.seek(off)
                h.update(f.read(n))
                # whole pages: the kernel drops only pages wholly inside the range
                a0 = off // _PAGE * _PAGE
                _advise(f.fileno(), a0, -(-(off + n) // _PAGE) * _PAGE - a0, "POSIX_FADV_DONTNEED")
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(memo, digest)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    """posix_fadvise where the platform has it (a hint: errors are ignored)."""
    if hasattr(os, advice):
        try:
            os.posix_fadvise(fd, offset, length, getattr(os, advice))
        except OSError:
            pass


def identity(model: ModelFile) -> dict[str, Any]:
    """The facts a trace or predictor records about its model."""
    return {
        "model_name": model.path.name,
        "fingerprint": fingerprint(model),
        "arch": model.arch,
        "n_layer": model.n_layer,
        "moe_layers": model.moe_layers(),
        "n_expert": model.n_expert,
        "top_k": model.n_expert_used,
        "n_embd": int(model.arch_kv("embedding_length", 0) or 0),
        "file_size": model.file_size,
    }


SHAPE_KEYS = ("arch", "moe_layers", "n_expert", "top_k", "n_embd")


def require_same_model(recorded: dict[str, Any], model: ModelFile, what: str, fix: str) -> None:
    """Raise ModelMismatchError unless ``recorded`` (an identity) describes ``model``."""
    if not recorded.get("fingerprint"):
        raise ModelMismatchError(f"{what} records no model identity; {fix}")
    current = identity(model)
    if recorded["fingerprint"] != current["fingerprint"]:
        shape = {k: recorded.get(k) for k in SHAPE_KEYS}
        same_shape = shape == {k: current[k] for k in SHAPE_KEYS}
        raise ModelMismatchError(
            f"{what} was made for {recorded.get('model_name', 'another model')} "
            f"(fingerprint {recorded['fingerprint'][:12]}), not for {model.path.name} "
            f"(fingerprint {current['fingerprint'][:12]}"
            f"{', same shape but other weights' if same_shape else ', another shape'}); {fix}")

