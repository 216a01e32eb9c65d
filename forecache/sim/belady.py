"""The fewest disk reads a routing allows: Belady's optimal offline replacement (evict the expert
whose next use is furthest in the future) over each layer's expert uses, with ``capacity``
experts of a layer in memory (device and host slots together, or the host slots alone).

A use of an expert not in memory is a read. A read need not be kept (a bypass: computed from a
transient buffer) when every expert held is used again sooner than it; otherwise it replaces the
held expert used again furthest in the future, which is optimal for uses one at a time
(Belady 1966; with bypass, Mattson et al. 1970). A step's experts (one token's top-k at one
layer) are distinct, so taking them one at a time in any order gives a lower bound for any
policy that serves the step's experts together.

``free_start``: the memory may hold any experts when the sequence begins (a prompt before a
decode reads nearly every expert anyway, and could leave any of them): the reads then are those
from empty less the cold fill (``min(capacity, distinct experts)``), which is the optimum over
every starting content (from empty, a policy can copy any start's run by reading its start's
experts on first use, at most ``capacity`` more reads).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

NEVER = np.iinfo(np.int64).max


def belady_misses(steps: Sequence[Sequence[int]], capacity: int) -> np.ndarray:
    """Reads at each step of one layer's uses (``steps[i]``: the distinct experts step ``i``
    uses) under Belady's replacement with bypass, from an empty memory of ``capacity``
    experts."""
    items = np.fromiter((int(e) for s in steps for e in s), dtype=np.int64)
    owner = np.repeat(np.arange(len(steps)), [len(s) for s in steps])
    n = len(items)
    nxt = np.full(n, NEVER, dtype=np.int64)
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        e = int(items[i])
        nxt[i] = last.get(e, NEVER)
        last[e] = i
    misses = np.zeros(len(steps), dtype=np.int64)
    held: dict[int, int] = {}  # expert -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, expert); stale entries skipped
    for i in range(n):
        e, nx = int(items[i]), int(nxt[i])
        if e in held:
            held[e] = nx
            heapq.heappush(heap, (-nx, e))
            continue
        misses[owner[i]] += 1
        if capacity <= 0:
            continue
        if len(held) < capacity:
            held[e] = nx
            heapq.heappush(heap, (-nx, e))
            continue
        while True:  # the held expert used again furthest ahead
            far, victim = heap[0]
            if held.get(victim) == -far:
                break
            heapq.heappop(heap)
        if nx < -far:
            heapq.heappop(heap)
            del held[victim]
            held[e] = nx
            heapq.heappush(heap, (-nx, e))
    return misses


def min_reads(steps: Sequence[Sequence[int]], capacity: int, *, free_start: bool = False) -> int:
    """The fewest reads ``steps`` of one layer need with ``capacity`` experts in memory, from
    an empty memory or (``free_start``) the best starting content."""
    got = int(belady_misses(steps, capacity).sum())
    if free_start:
        distinct = len({int(e) for s in steps for e in s})
        got -= min(capacity, distinct)
    return got
