"""Which model a trace or a trained predictor belongs to: a content fingerprint plus the shape.

Hashing a 32 GB GGUF on every start would cost a minute, so the fingerprint covers the metadata,
the tensor table and 4 KiB at four places in every tensor; any two different models (a retrained or
requantized one included) differ there. It leaves out what only the file layout decides (the
``split.*`` keys, the alignment, where each tensor lies), so a split model and the same model in
one file are the same model, and a trace or predictor of one serves the other. It is cached by
(path, size, mtime, inode) of every file.
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
FINGERPRINT_VERSION = 2
#: Keys the file layout writes, not the model: left out of the fingerprint.
LAYOUT_KEYS = ("split.no", "split.count", "split.tensors.count", "general.alignment")


class ModelMismatchError(ValueError):
    """A trace or predictor was made for another model; the message says which and what to do."""


def fingerprint(model: ModelFile) -> str:
    """sha256 over the model's metadata, tensor table and samples of every tensor's bytes, the
    same for a model in one file and split (cached per set of files)."""
    stats = [(f.resolve(), f.stat()) for f in model.files]
    key = "|".join(f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}" for p, st in stats)
    key += f"|{FINGERPRINT_VERSION}"
    memo = cache_dir() / "fingerprints" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".txt")
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    with open(model.path, "rb", buffering=0) as f:
        header = f.read(model.data_offset)
    for k, (a, b) in model.kv_spans.items():
        if k not in LAYOUT_KEYS:
            h.update(header[a:b])
    tensors = sorted(model.tensors, key=lambda t: t.name)
    for t in tensors:
        h.update(f"{t.name}|{list(t.shape)}|{int(t.type)}|".encode())
    files: dict[str, int] = {}
    try:
        for t in tensors:
            path, start = model.locate(t)
            fd = files.get(str(path))
            if fd is None:
                fd = files[str(path)] = os.open(path, os.O_RDONLY)
                # no readahead around the samples, and none of them left in the page cache: a
                # model larger than host memory has no room for them (its disk tier reads
                # experts itself)
                _advise(fd, 0, 0, "POSIX_FADV_RANDOM")
            for frac in (0, 1, 2, 3):
                off = start + max(0, (t.nbytes - _SAMPLE) * frac // 3)
                n = min(_SAMPLE, t.nbytes)
                h.update(os.pread(fd, n, off))
                # whole pages: the kernel drops only pages wholly inside the range
                a0 = off // _PAGE * _PAGE
                _advise(fd, a0, -(-(off + n) // _PAGE) * _PAGE - a0, "POSIX_FADV_DONTNEED")
    finally:
        for fd in files.values():
            os.close(fd)
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
        "model_name": model.name,
        "fingerprint": fingerprint(model),
        "arch": model.arch,
        "n_layer": model.n_layer,
        "moe_layers": model.moe_layers(),
        "n_expert": model.n_expert,
        "top_k": model.n_expert_used,
        "n_embd": int(model.arch_kv("embedding_length", 0) or 0),
        "file_size": model.file_size,
        "files": len(model.files),
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

