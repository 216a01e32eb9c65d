"""How fast this machine's disk reads experts: whole-expert reads of a file of its own, past the
page cache (direct I/O where the file system allows it), one at a time and several in flight, as
the disk tier reads (``forecache_cache_set_disk``)."""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

READ_BYTES = 4 << 20  # about one expert of a 4-bit 200-400B model (all projections)
QUEUE_DEPTHS = (1, 8)


def _open_direct(path: Path) -> tuple[int, bool]:
    """A descriptor for reading ``path`` with direct I/O, else a plain one."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:
            pass
    return os.open(path, os.O_RDONLY), False


def measure_disk(directory: Path, nbytes: int = 256 << 20) -> dict:
    """Write ``nbytes`` to a temporary file in ``directory``, then read it back in READ_BYTES
    reads at each of QUEUE_DEPTHS: the file system's rate (GB/s) at each depth and whether
    direct I/O was used. The file is removed afterwards."""
    directory.mkdir(parents=True, exist_ok=True)
    n = max(nbytes // READ_BYTES, max(QUEUE_DEPTHS))
    block = os.urandom(1 << 20) * (READ_BYTES >> 20)
    out: dict = {"path": str(directory), "read_bytes": READ_BYTES}
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".forecache-disk-probe-") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        fd, direct = _open_direct(Path(f.name))
        out["direct_io"] = direct
        try:
            for depth in QUEUE_DEPTHS:
                if not direct:  # a plain read of pages still cached measures memory
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                bufs = [mmap.mmap(-1, READ_BYTES) for _ in range(depth)]  # page-aligned

                def read(i: int, bufs: list[mmap.mmap] = bufs) -> int:
                    return os.preadv(fd, [bufs[i % len(bufs)]], i * READ_BYTES)

                t0 = time.perf_counter()
                with ThreadPoolExecutor(depth) as pool:
                    got = sum(pool.map(read, range(n)))
                dt = time.perf_counter() - t0
                out[f"qd{depth}_gbps"] = round(got / dt / 1e9, 2)
                for b in bufs:
                    b.close()
        finally:
            os.close(fd)
    return out
