"""The expert cache's test controls (forecache/csrc/forecache-testing.h), for tests and
benchmarks: pause the copy worker and run its chunks one at a time, route or time a layer
without a forward pass. Bound on first use by :func:`controls`; the runtime's binding
(``forecache.native.api()``) never looks them up."""

from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, c_bool, c_double, c_int32, c_size_t, c_void_p
from typing import TYPE_CHECKING

from forecache.native.binding import CFunctions, c_function
from forecache.native.libs import PatchedBuildError, libllama

if TYPE_CHECKING:
    from forecache.native.cache_api import CachePtr, Ptr


class ChunkInfo(ctypes.Structure):
    """struct forecache_chunk_info: one chunk copy run by forecache_cache_step."""

    _fields_ = [
        ("layer", c_int32),
        ("slot", c_int32),
        ("proj", c_int32),
        ("expert", c_int32),
        ("priority", c_int32),
        ("size", c_size_t),
    ]


class ForecacheTestControls(CFunctions):
    """forecache-testing.h's functions: ``controls().cache_step(...)`` calls
    ``forecache_cache_step``."""

    prefix = "forecache_"

    @c_function([c_void_p, c_bool], None)
    def cache_pause(cache: CachePtr, paused: bool) -> None:
        """Stop (True) or restart the copy worker; while stopped, cache_step runs the copies."""

    @c_function([c_void_p, POINTER(ChunkInfo)], c_int32)
    def cache_step(cache: CachePtr, out: Ptr[ChunkInfo]) -> int:
        """Run the next eligible queued chunk here, described in ``out``: 0, or 1 if none can
        run."""

    @c_function([c_void_p, c_int32, c_int32], c_int32)
    def cache_queued(cache: CachePtr, layer: int, priority: int) -> int:
        """Queued chunks of ``layer`` (-1: all) with exactly ``priority`` (-1: any)."""

    @c_function([], c_size_t)
    def chunk_info_size() -> int:
        """sizeof(struct forecache_chunk_info)."""

    @c_function([c_void_p, c_int32, c_bool], c_double)
    def cache_host_handoff(cache: CachePtr, n: int, fresh_threads: bool) -> float:
        """Seconds per empty job handed to the host-entries thread over ``n`` jobs (with
        ``fresh_threads``: per thread started and joined)."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), c_int32, c_bool], c_int32)
    def cache_test_route(cache: CachePtr, layer: int, experts: Ptr[c_int32], n: int,
                         decode_gate: bool) -> int:
        """Route ``layer`` as a one-token ubatch to ``experts`` without computing it: 0 slots,
        1 host, 2 the hook would be called, -1 bad arguments."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_int32)], c_int32)
    def cache_test_schedule(cache: CachePtr, layer: int, experts: Ptr[c_int32],
                            slots: Ptr[c_int32]) -> int:
        """``layer``'s schedule (experts and slots, -1 for host entries): its length, or -1."""

    @c_function([c_void_p, c_int32, c_int32, c_int32, c_int32, c_bool, c_int32, c_int32],
                c_double)
    def cache_expert_matmul(cache: CachePtr, layer: int, proj: int, n_rows: int, n_used: int,
                            repacked: bool, n_threads: int, n_iter: int) -> float:
        """Seconds per CPU MUL_MAT_ID of ``proj`` of ``layer``'s host experts (``repacked``: a
        repacked copy): -1 bad arguments, -2 no repacked kernel, -3 a step failed."""


@functools.cache
def controls() -> ForecacheTestControls:
    """forecache-testing.h's functions on libllama, with their struct's size checked."""
    bound = ForecacheTestControls.bind(libllama())
    size = bound.chunk_info_size()
    if size != ctypes.sizeof(ChunkInfo):
        raise PatchedBuildError(f"ChunkInfo: {ctypes.sizeof(ChunkInfo)} bytes, C {size}: the "
                                f"mirror in forecache.native.testing or the build is out of date")
    return bound
