"""How fast this machine's disk reads experts: whole-expert reads past the page cache (direct I/O
where the file system allows it), one at a time and several in flight, as the disk tier reads
(``forecache_cache_set_disk``): of a file of its own (``doctor``), or of a model file's experts
when a run starts with a disk tier (its cost model prices reads by it)."""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


def _timed_reads(spans: Sequence[tuple[int, int, int]], workers: int, direct: bool
                 ) -> tuple[float, int]:
    """Read ``spans`` (descriptor, aligned offset, size), ``workers`` at a time, into
    page-aligned buffers: (seconds, bytes read). Without direct I/O their pages are dropped from
    the page cache before (a cached page measures memory) and after (the reads leave nothing
    behind)."""
    def drop() -> None:
        if not direct:
            for fd, off, n in spans:
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)

    size = max(n for _, _, n in spans)
    bufs = [mmap.mmap(-1, size) for _ in range(workers)]

    def read(i: int) -> int:
        fd, off, n = spans[i]
        view = memoryview(bufs[i % workers])[:n]
        try:
            return os.preadv(fd, [view], off)
        finally:
            view.release()

    drop()
    try:
        t0 = time.perf_counter()
        if workers == 1:
            got = sum(read(i) for i in range(len(spans)))
        else:
            with ThreadPoolExecutor(workers) as pool:
                got = sum(pool.map(read, range(len(spans))))
        dt = time.perf_counter() - t0
    finally:
        for b in bufs:
            b.close()
    drop()
    return dt, got


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
            spans = [(fd, i * READ_BYTES, READ_BYTES) for i in range(n)]
            for depth in QUEUE_DEPTHS:
                dt, got = _timed_reads(spans, depth, direct)
                out[f"qd{depth}_gbps"] = round(got / dt / 1e9, 2)
        finally:
            os.close(fd)
    return out


ALIGN = 4096  # direct I/O wants offsets, sizes and buffers on the logical block size


@dataclass(frozen=True)
class DiskRate:
    """What reading a model file's experts costs, measured: the rate with ``depth`` reads in
    flight, one read's fixed cost (from reads one at a time), and whether direct I/O was used."""

    gbps: float
    latency_s: float
    depth: int
    direct: bool

    def describe(self) -> str:
        """One line for the user."""
        return (f"{self.gbps:.2f} GB/s with {self.depth} reads in flight, "
                f"{self.latency_s * 1e6:.0f} us a read"
                f"{'' if self.direct else ' (buffered: this file system refuses direct I/O)'}")


def measure_reads(ranges: Sequence[tuple[Path, int, int]], depth: int) -> DiskRate:
    """Read ``ranges`` (file, offset, size) as the disk tier reads experts: first a few one
    at a time, then all of them ``depth`` at a time, past the page cache (direct I/O where the
    file system allows it, else plain reads of pages dropped from the cache first). The
    first reads cost each read's latency plus its bytes; the second the disk's rate. The
    files may be several: a split model's shards."""
    if not ranges:
        raise ValueError("measure_reads needs at least one range to read")
    opened: dict[Path, tuple[int, bool]] = {}
    try:
        for path, _, _ in ranges:
            if path not in opened:
                opened[path] = _open_direct(path)
        direct = all(d for _, d in opened.values())
        spans = [(opened[path][0], off // ALIGN * ALIGN,
                  -(-(off + n) // ALIGN) * ALIGN - off // ALIGN * ALIGN)
                 for path, off, n in ranges]
        n1 = min(len(spans), 4)
        one_s, one_bytes = _timed_reads(spans[:n1], 1, direct)
        all_s, all_bytes = _timed_reads(spans, max(depth, 1), direct)
    finally:
        for fd, _ in opened.values():
            os.close(fd)
    gbps = all_bytes / max(all_s, 1e-9) / 1e9
    latency = max(0.0, one_s / n1 - one_bytes / n1 / (gbps * 1e9))
    return DiskRate(round(gbps, 3), latency, max(depth, 1), direct)
