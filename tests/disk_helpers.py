"""For the disk tier's tests: a budget that leaves three quarters of the experts in the file, and
what the kernel's page cache holds of a file (the tier's reads must leave no expert page
behind)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from forecache.cache.disk import host_weight_bytes
from forecache.gguf.header import ModelFile


def quarter_budget(mf: ModelFile, slot_fraction: float) -> int:
    """Host memory for the non-expert weights, the (host-memory) slots of a CPU build holding
    ``slot_fraction`` of each layer's experts, and a quarter of the experts."""
    per = max(mf.layer_expert_bytes())
    slots = sum(max(1, round(slot_fraction * mf.n_expert)) for _ in mf.moe_layers())
    return host_weight_bytes(mf, on_gpu=False) + slots * per + mf.total_expert_bytes() // 4


def drop_cached(path: Path) -> None:
    """Drop ``path``'s pages from the kernel's page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_pages(path: Path, ranges: list[tuple[int, int]]) -> int:
    """Pages wholly inside ``ranges`` (file offsets) that the page cache holds now (mincore); a
    page shared with a neighbouring tensor is read with that tensor."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    n = 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        for start, end in ranges:
            a0, a1 = -(-start // page) * page, end // page * page
            if a1 <= a0:
                continue
            vec = (ctypes.c_ubyte * ((a1 - a0) // page))()
            if libc.mincore(ctypes.c_void_p(base + a0), ctypes.c_size_t(a1 - a0), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            n += sum(v & 1 for v in vec)
    return n


def direct_io(path: Path) -> bool:
    """Whether the file system lets ``path`` be read with direct I/O."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True
