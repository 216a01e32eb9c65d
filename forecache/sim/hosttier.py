"""The disk tier in virtual time: forecache's host expert slots over the model file, and the
kernel's page cache over an mmap'd file (stock llama.cpp's default for a model larger than RAM).

``HostTier`` follows the C cache's disk tier (csrc/forecache-cache-disk.cpp): each MoE layer
has ``n_host`` host slots, empty at the start; a copy into a device slot, or a host compute,
needs its expert in a host slot, and a missing one is read from the file, whole, by one of
``queue_depth`` readers, highest priority first (FIFO within a priority). A read takes a host
slot from an empty one, else from the expert used least often (uses of an expert are kept
across evictions), then least recently, whose read is done and that no copy or host compute
needs; failing that, from one whose queued copies all wait for their device slot to be
consumed (a schedule streaming more experts than the host slots hold), read again once one of
those copies could run. A read costs one ``latency`` per projection (the readers ``pread``
each projection's slab) plus its bytes at the disk's rate, which the reads moving bytes share,
as they share DRAM with copies and CPU compute (``Profile.dram_factor``).

``PageCache`` is llama.cpp's mmap'd experts: the kernel keeps the pages of the experts last
used (LRU; an expert's pages are always read together, so they age together) in the host
memory left to it, and a thread computing an expert it lacks faults its pages in
synchronously, read-ahead window by window.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forecache.cache.cost import DiskProfile, Profile

if TYPE_CHECKING:
    from forecache.sim.engine import SimEngine

# the priority of reads the disk window asks for: below the copy engine's predicted copies (LOW)
DISK_PREFETCH = 2
# host-tier eviction orders (``HostTier.evict``): "uses", the C tier's (fewest uses, then least
# recently used); "lru" (least recently used); "device-first" ("uses", but experts that have a
# device slot go first: the device serves them, so the host keeps other experts); "predicted"
# ("uses", a prediction of the disk window counting as a use: MoE-Infinity's predicted next use);
# "request" (fewest uses in the current request, as MoE-Infinity's per-request expert activation
# counts, then "uses")
HOST_EVICTIONS = ("uses", "lru", "device-first", "predicted", "request")


@dataclass
class _Read:
    layer: int
    expert: int
    slot: int
    flowing_at: float  # its latencies are over: bytes flow from then on
    left: float  # bytes still to come
    order: tuple[int, int] = (0, 0)  # (priority, queue sequence): who is served first


@dataclass
class _HostLayer:
    n_host: int
    expert_of: list[int]  # host slot -> expert, -1 empty
    ready: list[bool]  # host slot -> its read is done
    stamp: list[int]  # host slot -> last use (the tier's clock)
    busy: list[int]  # host slot -> copies and computes reading it now
    slot_of: dict[int, int] = field(default_factory=dict)  # expert -> host slot
    want: dict[int, int] = field(default_factory=dict)  # expert -> queued or running chunks
    hold: dict[int, int] = field(default_factory=dict)  # expert -> host computes needing it
    uses: dict[int, int] = field(default_factory=dict)  # expert -> times needed, kept on eviction
    req_uses: dict[int, int] = field(default_factory=dict)  # expert -> times needed this request


@dataclass
class DiskStats:
    """What the disk tier did: reads (whole experts) and their bytes, in all and while decode
    tokens ran; host-tier hits and misses (a copy queued or a host compute batch that found
    its expert read, or not); evictions, and of those the experts only waiting copies wanted
    (``displaced``: read again later)."""

    reads: int = 0
    bytes: int = 0
    decode_reads: int = 0
    decode_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    displaced: int = 0
    demoted: int = 0  # exclusive tiers: experts written back from the device to a host slot


class HostTier:
    """forecache's host expert slots over the model file, in the engine's virtual time."""

    def __init__(self, engine: SimEngine, n_host: Sequence[int], n_proj: int,
                 expert_bytes: int, profile: Profile, evict: str = "uses", *,
                 exclusive: bool = False, read_ahead: bool = True, ordered: bool = False) -> None:
        if evict not in HOST_EVICTIONS:
            raise ValueError(f"host eviction {evict!r}: one of {', '.join(HOST_EVICTIONS)}")
        self.evict = evict
        # ordered: the readers work on the first read in priority order, piece by piece, all
        # of them at once, so reads end one after another at the disk's full rate (a needed
        # read overtakes predicted ones at the next piece) instead of sharing it and ending
        # together
        self.ordered = ordered
        self.exclusive = exclusive
        self.read_ahead = read_ahead
        if profile.disk is None:
            raise ValueError(f"profile {profile.name} has no disk section: the disk tier needs "
                             "its rate, latency and queue depth")
        self.eng = engine
        self.profile = profile
        self.disk: DiskProfile = profile.disk
        self.n_proj = n_proj
        self.expert_bytes = expert_bytes
        self.layers = [_HostLayer(n, [-1] * n, [False] * n, [0] * n, [0] * n) for n in n_host]
        self.clock = 0
        self.queue: list[tuple[int, int, int, int]] = []  # (priority, seq, layer, expert)
        self.queued: dict[tuple[int, int], int] = {}  # (layer, expert) -> queued priority
        self._seq = itertools.count()
        self.flying: list[_Read] = []
        self.ready_at: dict[tuple[int, int], float] = {}  # when each held expert's read ended
        # wanted experts a read displaced: read again when one of their copies could run
        self.orphans: set[tuple[int, int]] = set()
        self.decoding = False  # reads issued now count as the decode's
        self.stats = DiskStats()
        self._t = 0.0  # when the flying reads' bytes were last brought up to date
        self._rate = 0.0  # bytes/s each flowing read gets since then
        self._version = 0  # of the one pending completion event

    # -- what the engine and the simulator ask -------------------------------------------------
    def present(self, layer: int, expert: int) -> bool:
        """``expert`` of ``layer`` is in a host slot, its read done."""
        L = self.layers[layer]
        s = L.slot_of.get(expert)
        return s is not None and L.ready[s]

    def resident(self, layer: int) -> set[int] | None:
        """The experts of ``layer`` in host slots with their reads done; None for a layer
        without host slots (its experts all in host memory)."""
        L = self.layers[layer]
        if L.n_host == 0:
            return None
        return {e for e, s in L.slot_of.items() if L.ready[s]}

    def use(self, layer: int, expert: int, priority: int) -> None:
        """A copy of ``expert`` is queued, or a host compute takes it: counted as a use, a hit
        or a miss, and read at ``priority`` when missing (as fc_queue_copy, fc_host_rows)."""
        L = self.layers[layer]
        L.uses[expert] = L.uses.get(expert, 0) + 1
        L.req_uses[expert] = L.req_uses.get(expert, 0) + 1
        if self.present(layer, expert):
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            # without read-ahead a decode token's predicted copy waits for its layer's routing
            # to want it (``SimEngine.preempt`` asks for its read then)
            if priority == 0 or self.read_ahead or not self.decoding:
                self.request(layer, expert, priority)

    def want(self, layer: int, expert: int, d: int) -> None:
        """A chunk copying ``expert`` queued (+1), or done or dropped (-1)."""
        self._count(self.layers[layer].want, expert, d)

    def compute(self, layer: int, expert: int, d: int) -> None:
        """A host compute needs ``expert`` (+1: it waits for it or reads it), or is done."""
        self._count(self.layers[layer].hold, expert, d)

    def _count(self, counts: dict[int, int], expert: int, d: int) -> None:
        n = counts.get(expert, 0) + d
        if n:
            counts[expert] = n
        else:
            counts.pop(expert, None)
            self._dispatch()  # its host slot may be taken again

    def hold(self, layer: int, expert: int, d: int, *, stamp: bool) -> None:
        """A copy or host compute starts (+1) or stops (-1) reading ``expert``'s host slot;
        ``stamp``: the slot counts as used now (a copy's start, a host compute's end)."""
        L = self.layers[layer]
        s = L.slot_of.get(expert)
        if s is None:
            return
        L.busy[s] += d
        if stamp:
            self.clock += 1
            L.stamp[s] = self.clock
        if d < 0:
            self._dispatch()

    def touch(self, layer: int, expert: int) -> None:
        """``expert``'s host slot counts as used now (a host compute of it ended)."""
        L = self.layers[layer]
        s = L.slot_of.get(expert)
        if s is not None:
            self.clock += 1
            L.stamp[s] = self.clock

    def request(self, layer: int, expert: int, priority: int) -> bool:
        """Queue a read of ``expert`` unless it is held, or queued at ``priority`` or higher
        (``fc_disk_request``); True if queued."""
        L = self.layers[layer]
        if L.n_host == 0 or expert in L.slot_of:
            return False
        key = (layer, expert)
        if self.queued.get(key, priority + 1) <= priority:
            return False
        self.queued[key] = priority
        heapq.heappush(self.queue, (priority, next(self._seq), layer, expert))
        self._dispatch()
        return True

    def prefetch(self, layer: int, experts: Sequence[int], priority: int = DISK_PREFETCH) -> int:
        """The disk window's reads (``forecache_cache_disk_read``): the experts not held or
        queued higher are queued; returns how many."""
        if self.evict == "predicted":
            L = self.layers[layer]
            for e in experts:
                L.uses[int(e)] = L.uses.get(int(e), 0) + 1
        return sum(self.request(layer, int(e), priority) for e in experts)

    def begin_request(self) -> None:
        """A request starts: its own uses are counted from none ("request" eviction)."""
        for L in self.layers:
            L.req_uses.clear()

    def demote(self, layer: int, expert: int) -> None:
        """Exclusive tiers: ``expert``, copied, leaves its device slot; written back over the
        bus (device to host, beside the host-to-device copies) into a host slot unless it
        holds one, or the victim is used more than it is."""
        L = self.layers[layer]
        if L.n_host == 0 or expert in L.slot_of:
            return
        s = self._victim(layer, L)
        if s < 0:
            return
        old = L.expert_of[s]
        if old in L.want:
            return  # only waiting copies want it: not displaced for a write-back
        if old >= 0 and not self.eng.copied(layer, old) and \
                self._key(L, old, L.stamp[s]) > self._key(L, expert, self.clock + 1):
            return
        if old >= 0:
            del L.slot_of[old]
            self.ready_at.pop((layer, old), None)
            self.stats.evictions += 1
            if old in L.want:
                self.stats.displaced += 1
                self.orphans.add((layer, old))
        if (layer, expert) in self.queued:  # no read: the write-back brings it
            del self.queued[(layer, expert)]
        L.expert_of[s] = expert
        L.slot_of[expert] = s
        L.ready[s] = False
        self.stats.demoted += 1
        p = self.profile
        done = self.eng.now + p.chunk_latency_s + self.expert_bytes / (p.h2d_gbps * 1e9)
        self.eng.at(done, lambda: self._landed(layer, expert, s))

    def _landed(self, layer: int, expert: int, s: int) -> None:
        """A write-back from the device is in its host slot."""
        L = self.layers[layer]
        if L.expert_of[s] != expert or L.ready[s]:
            return
        L.ready[s] = True
        self.clock += 1
        L.stamp[s] = self.clock
        self.ready_at[(layer, expert)] = self.eng.now
        self._dispatch()

    def _key(self, L: _HostLayer, e: int, stamp: int) -> tuple:
        """``e``'s eviction key (lowest goes first) by ``evict``."""
        if self.evict == "lru":
            return (0, 0, stamp)
        if self.evict == "request":
            return (L.req_uses.get(e, 0), L.uses.get(e, 0), stamp)
        return (0, L.uses.get(e, 0), stamp)

    def flowing(self) -> bool:
        """A read is moving bytes into DRAM now."""
        return bool(self._served(self.eng.now))

    # -- reads --------------------------------------------------------------------------------
    def _victim(self, il: int, L: _HostLayer) -> int:
        """An empty host slot, else by ``evict`` (the C tier's ``fc_host_victim``: the least
        used, least recently used expert) one whose read is done and that no copy or host
        compute needs or reads; failing that, one that only queued copies want, none of which
        could run now (each waits for its device slot to be consumed); -1 when none."""
        best, key = -1, None
        blocked, bkey = -1, None
        runnable: set[int] | None = None
        on_device = self.eng.layers[il].slot_of if self.evict == "device-first" else {}
        for s in range(L.n_host):
            e = L.expert_of[s]
            if e < 0:
                return s
            if not L.ready[s] or L.busy[s] or e in L.hold:
                continue
            # exclusive tiers: an expert copied to the device has no claim to a host slot
            first = not self.eng.copied(il, e) if self.exclusive else e not in on_device
            k = (first, *self._key(L, e, L.stamp[s]))
            if e not in L.want:
                if key is None or k < key:
                    best, key = s, k
            elif best < 0:
                if runnable is None:
                    runnable = self.eng.runnable_experts(il)
                if e not in runnable and (bkey is None or k < bkey):
                    blocked, bkey = s, k
        return best if best >= 0 else blocked

    def _pop(self) -> tuple[int, int, int] | None:
        """The first queued read, in priority order, whose layer has a host slot for it."""
        skipped = []
        got = None
        no_room: set[int] = set()
        while self.queue:
            item = heapq.heappop(self.queue)
            p, seq, il, e = item
            if self.queued.get((il, e)) != p or e in self.layers[il].slot_of:
                continue  # queued again higher, or read already
            if not self._room_for(p):
                skipped.append(item)
                break
            s = -1 if il in no_room else self._victim(il, self.layers[il])
            if s < 0:
                no_room.add(il)
                skipped.append(item)
                continue
            got = (il, e, s, (p, seq))
            break
        for item in skipped:
            heapq.heappush(self.queue, item)
        return got

    def _room_for(self, priority: int) -> bool:
        """A reader is free for a read at ``priority``: fewer than the queue depth are in
        flight, or, served in order, fewer at this priority or above (the others pause at
        their next piece)."""
        if not self.ordered:
            return len(self.flying) < self.disk.queue_depth
        return sum(r.order[0] <= priority for r in self.flying) < self.disk.queue_depth

    def _dispatch(self) -> None:
        """Start queued reads while readers are free."""
        started = False
        while self.queue and (self.ordered or len(self.flying) < self.disk.queue_depth):
            got = self._pop()
            if got is None:
                break
            il, e, s, order = got
            self._start(il, e, s, order)
            started = True
        if started:
            self._reschedule()

    def _served(self, now: float) -> list[_Read]:
        """The reads moving bytes now: every flowing one, or, served in order, the first."""
        flowing = [r for r in self.flying if r.flowing_at <= now]
        if self.ordered and flowing:
            return [min(flowing, key=lambda r: r.order)]
        return flowing

    def _start(self, il: int, e: int, s: int, order: tuple[int, int] = (0, 0)) -> None:
        self._progress()
        L = self.layers[il]
        old = L.expert_of[s]
        if old >= 0:
            del L.slot_of[old]
            self.ready_at.pop((il, old), None)
            self.stats.evictions += 1
            if old in L.want:  # its copies wait: read again when one could run
                self.stats.displaced += 1
                self.orphans.add((il, old))
        L.expert_of[s] = e
        L.slot_of[e] = s
        L.ready[s] = False
        del self.queued[(il, e)]
        now = self.eng.now
        self.flying.append(_Read(il, e, s, now + self.n_proj * self.disk.latency_s,
                                 float(self.expert_bytes), order))

    def _progress(self) -> None:
        """Bring the flying reads' bytes up to now (the flowing set is constant between
        events: every latency's end is one)."""
        now = self.eng.now
        flowing = self._served(self._t)
        if flowing and now > self._t:
            got = (now - self._t) * self._rate
            for r in flowing:
                r.left -= got
        self._t = now

    def _reschedule(self) -> None:
        """The next completion or latency end, as one engine event (older ones go stale)."""
        now = self.eng.now
        flowing = self._served(now)
        eng = self.eng
        factor = self.profile.dram_factor(copy=eng.running is not None,
                                          cpu=now < eng.cpu_busy_until, disk=True)
        self._rate = self.disk.gbps * 1e9 * factor / max(len(flowing), 1)
        self._t = now
        nxt = math.inf
        if flowing:
            nxt = now + max(min(r.left for r in flowing), 0.0) / self._rate
        for r in self.flying:
            if r.flowing_at > now:
                nxt = min(nxt, r.flowing_at)
        self._version += 1
        if nxt < math.inf:
            eng.post(nxt, "disk", self._version)

    def on_event(self, version: int) -> None:
        """A completion or latency end the engine's clock reached."""
        if version != self._version:
            return
        self._progress()
        now = self.eng.now
        done = [r for r in self.flying if r.flowing_at <= now and r.left < 1.0]
        for r in done:
            self.flying.remove(r)
            L = self.layers[r.layer]
            L.ready[r.slot] = True
            self.clock += 1
            L.stamp[r.slot] = self.clock  # a newly read expert counts as just used
            self.ready_at[(r.layer, r.expert)] = now
            self.stats.reads += 1
            self.stats.bytes += self.expert_bytes
            if self.decoding:
                self.stats.decode_reads += 1
                self.stats.decode_bytes += self.expert_bytes
        self._reschedule()
        self._dispatch()

    def request_orphans(self, priority_of: Callable[[int, int], int | None]) -> None:
        """Read the displaced experts one of whose copies could run now, at that copy's
        priority (``priority_of``; None: none could), as the C copy worker's
        ``fc_request_reads``."""
        for key in list(self.orphans):
            il, e = key
            L = self.layers[il]
            if e in L.slot_of or e not in L.want:
                self.orphans.discard(key)
                continue
            p = priority_of(il, e)
            if p is not None:
                self.orphans.discard(key)
                self.request(il, e, p)


def fault_s(proj_bytes: Sequence[int], disk: DiskProfile, queue_depth: int = 1
            ) -> tuple[float, int]:
    """Seconds and reads to fault in one mmap'd expert: each projection's slab read-ahead
    window by window, ``queue_depth`` windows at a time sharing the disk's rate (1: a
    faulting thread waits for each)."""
    ra = disk.readahead_bytes
    n = sum(math.ceil(nb / ra) for nb in proj_bytes)
    return math.ceil(n / queue_depth) * disk.latency_s + sum(proj_bytes) / (disk.gbps * 1e9), n


class PageCache:
    """The kernel's page cache over mmap'd experts: ``capacity`` experts, least recently used
    out first, empty at the start."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.hits = self.misses = 0

    def access(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Touch ``experts`` of ``layer``; the ones that were not cached (faulted in now)."""
        missed = []
        for e in experts:
            key = (layer, int(e))
            if key in self.lru:
                self.lru.move_to_end(key)
                self.hits += 1
                continue
            self.misses += 1
            missed.append(int(e))
            self.lru[key] = None
            if len(self.lru) > self.capacity:
                self.lru.popitem(last=False)
        return missed
