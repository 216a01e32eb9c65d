"""The C copy engine's contract in virtual time: what a policy drives in simulation.

``SimEngine`` has the calls of ``cache.runtime.ExpertCache`` (load, preempt, schedule,
layer_state and the slot states the node hook waits on) and keeps time by the profile: one
worker per device link copying chunks highest priority first (a layer's chunks over its
device's link, ``bus_of``), streamed copies that wait for their slot's previous
expert, the in-use guard. A test holds it to the C engine's slot states and copy order. With a
disk tier (``disk``, ``sim.hosttier.HostTier``) a chunk also waits for its expert's read.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from forecache.cache.cost import Profile
from forecache.cache.prefetcher import HIGH, SLOT_COPYING, SLOT_EMPTY, SLOT_QUEUED, SLOT_READY
from forecache.sim.hosttier import HostTier
from forecache.sim.shapes import ModelShape

N_PRIORITIES = 4


@dataclass
class _Chunk:
    layer: int
    slot: int
    proj: int  # -1: the whole expert
    expert: int
    priority: int
    entry: int  # streamed copy: schedule entry; -1 plain load
    need: int
    first: bool
    size: int
    queued_at: float


@dataclass
class _Layer:
    n_slots: int
    n_proj: int
    expert_of: list[int]
    slot_of: dict[int, int] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)
    pend_proj: list[list[int]] = field(default_factory=list)
    started: list[bool] = field(default_factory=list)
    in_use: list[bool] = field(default_factory=list)
    last_entry: list[int] = field(default_factory=list)
    sch_e: list[int] = field(default_factory=list)
    sch_s: list[int] = field(default_factory=list)
    sch_first: list[bool] = field(default_factory=list)
    entry_pend: list[list[int]] = field(default_factory=list)
    consumed: list[list[int]] = field(default_factory=list)
    streams: bool = False
    n_dev: int = 0  # entries [0, n_dev) from slots, the rest from host memory
    stamp: list[int] = field(default_factory=list)  # slot -> when last used (recency)
    key: list[int] = field(default_factory=list)  # expert -> eviction key (lowest goes first)
    key_step: int = 0  # added to a routed expert's key per token row
    routed_pass: int = 0  # the forward pass the layer was last routed in
    used: list[bool] = field(default_factory=list)  # slot -> computed from since its copy


class SimEngine:
    """The C copy engine's contract in virtual time (csrc/forecache.h, forecache-cache.cpp)."""

    def __init__(self, shape: ModelShape, n_slots: Sequence[int], profile: Profile, *,
                 whole_expert_chunks: bool = False, n_stage: int = 0,
                 bus_of: Sequence[int] | None = None) -> None:
        self.shape = shape
        # the device link each layer's copies take (None: one device); each link has its own
        # worker, all of them reading the one host store
        self.bus_of = list(bus_of) if bus_of is not None else [0] * len(n_slots)
        if len(self.bus_of) != len(n_slots):
            raise ValueError(f"{len(self.bus_of)} layer devices for {len(n_slots)} layers")
        self.n_buses = max(self.bus_of, default=0) + 1
        self.profile = profile
        self.whole = whole_expert_chunks
        n_proj = len(shape.proj_bytes)
        self.layers = [_Layer(n, n_proj, [-1] * n, pending=[0] * n,
                              pend_proj=[[0] * n_proj for _ in range(n)], started=[False] * n,
                              in_use=[False] * n, last_entry=[-1] * n, stamp=[0] * n,
                              key=[0] * shape.experts, used=[False] * n)
                       for n in n_slots]
        # stage slots: device memory outside every layer's slots, lent to one layer's expert at a
        # time (forecache_cache_stage); chunk.slot n_slots + j of its layer is stage slot j
        self.n_stage = n_stage
        self.stage_of: list[tuple[int, int] | None] = [None] * n_stage  # (layer, expert)
        self.stage_pend = [[0] * n_proj for _ in range(n_stage)]
        self.stage_started = [False] * n_stage
        self.stage_in_use = [False] * n_stage
        self.clock = 0  # recency stamps, as the C cache's
        self.epoch = 0  # forward passes: the simulator starts one per ubatch (``new_pass``)
        self.queue: list[deque[_Chunk]] = [deque() for _ in range(N_PRIORITIES)]
        # chunks in the queues by layer and by (layer, slot): a drop that would find none of
        # them does not scan the queues (it is most of a long replay's time otherwise)
        self._queued_layer = [0] * len(self.layers)
        self._queued_slot: dict[tuple[int, int], int] = {}
        self.now = 0.0
        self.busy_until = 0.0
        self.runs: list[_Chunk | None] = [None] * self.n_buses  # each link's copying chunk
        self.cpu_busy_until = 0.0  # the CPU computes experts from DRAM until then
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.in_use_layer = -1
        self.paused = False  # as forecache_cache_pause: no copy starts
        self.low_start = float("-inf")  # when the last lower-priority chunk started
        self.low_end = float("-inf")  # and finished
        self.disk: HostTier | None = None  # the host tier over the file (``attach_disk``)
        self.stats = {"h2d_bytes": 0, "n_chunks": 0, "hi_wait_s": 0.0, "hi_wait_max_s": 0.0,
                      "hi_tasks": 0, "dropped_chunks": 0, "refused_loads": 0, "streamed": 0,
                      "host_entries": 0, "hi_block_s": 0.0, "hi_block_max_s": 0.0,
                      "staged": 0, "stage_used": 0}
        if self.n_buses > 1:  # bytes over each device's link
            self.stats.update({f"h2d_bytes_dev{d}": 0 for d in range(self.n_buses)})

    @property
    def running(self) -> _Chunk | None:
        """A chunk being copied over some link (None: every link is idle)."""
        return next((c for c in self.runs if c is not None), None)

    def attach_disk(self, n_host: Sequence[int], evict: str = "uses",
                    exclusive: bool = False, read_ahead: bool = True,
                    ordered: bool = False) -> HostTier:
        """Give each layer ``n_host[layer]`` host slots over the model file (the C cache's
        ``forecache_cache_set_disk``), evicted by ``evict``: from now on copies wait for their
        experts' reads. ``exclusive``, ``read_ahead``, ``ordered``: as ``HostTier``'s."""
        self.disk = HostTier(self, n_host, len(self.shape.proj_bytes), self.shape.expert_bytes,
                             self.profile, evict, exclusive=exclusive, read_ahead=read_ahead,
                             ordered=ordered)
        return self.disk

    def copied(self, layer: int, expert: int) -> bool:
        """``expert`` of ``layer`` is in a device slot, its copy done."""
        L = self.layers[layer]
        s = L.slot_of.get(expert)
        return s is not None and L.pending[s] == 0 and L.last_entry[s] < 0

    # -- the copy engine a policy drives (called at self.now) ----------------------------------
    def load(self, layer: int, expert: int, slot: int, priority: int) -> int:
        L = self.layers[layer]
        if L.expert_of[slot] == expert:
            return 0
        prev = L.slot_of.get(expert, -1)
        if L.in_use[slot] or (prev >= 0 and L.in_use[prev]):
            self.stats["refused_loads"] += 1
            return 1
        for s in (slot, prev):
            if s >= 0:
                self._evict(layer, s)
        self._map(L, expert, slot)
        self._queue_copy(layer, expert, slot, -1, priority, -1, 0)
        self._stamp(L, slot)
        self._kick()
        return 0

    def preempt(self, layer: int, keep: Sequence[int]) -> int:
        wanted = set(int(e) for e in keep)
        for p in range(1, N_PRIORITIES) if self._queued_layer[layer] else ():
            moved = [c for c in self.queue[p]
                     if c.layer == layer and c.entry < 0 and c.expert in wanted]
            for c in moved:
                self.queue[p].remove(c)
                if c.first:
                    c.queued_at = self.now
                    self.stats["hi_tasks"] += 1
                c.priority = 0
                self.queue[0].append(c)
                if self.disk is not None:  # a needed expert's read before predicted ones
                    self.disk.request(layer, c.expert, 0)
        n = self._drop(1, layer, lambda c: c.entry < 0)
        self._kick()
        return n

    def schedule(self, layer: int, experts: Sequence[int], slots: Sequence[int],
                 priority: int) -> int:
        L = self.layers[layer]
        n = len(experts)
        n_dev = next((i for i, s in enumerate(slots) if s < 0), n)  # host entries from there on
        if (n == 0 or len(set(experts)) != n or any(s != -1 for s in slots[n_dev:])
                or any(not (0 <= s < L.n_slots or self._staged_at(layer, e, s))
                       for e, s in zip(experts[:n_dev], slots[:n_dev], strict=True))):
            return -1
        self._clear_schedule(layer)
        named = {s - L.n_slots for s in slots[:n_dev] if s >= L.n_slots}
        for j in range(self.n_stage):
            if self.stage_of[j] is not None and self.stage_of[j][0] == layer:
                if j in named:
                    self.stage_in_use[j] = True
                    self.stats["stage_used"] += 1
                else:
                    self._release_stage(j)
        L.sch_e, L.sch_s = [int(e) for e in experts], [int(s) for s in slots]
        L.sch_first = [False] * n
        L.n_dev = n_dev
        self.stats["host_entries"] += n - n_dev
        n = n_dev
        L.entry_pend = [[0] * L.n_proj for _ in range(n)]
        L.consumed = [[0] * L.n_proj for _ in range(L.n_slots)]
        L.in_use = [False] * L.n_slots
        uses = [0] * L.n_slots
        need = [0] * n
        copy = [False] * n
        for i, (e, s) in enumerate(zip(L.sch_e[:n], L.sch_s[:n], strict=True)):
            if s >= L.n_slots:  # a stage slot: staged for this expert, used once
                L.sch_first[i] = True
                continue
            need[i] = uses[s]
            uses[s] += 1
            if need[i] == 0:
                L.sch_first[i] = True
                copy[i] = L.expert_of[s] != e
            else:
                L.streams = True
                copy[i] = True
                self.stats["streamed"] += 1
        for i in range(n):
            if L.sch_first[i] and copy[i]:
                e, s = L.sch_e[i], L.sch_s[i]
                for t in (s, L.slot_of.get(e, -1)):
                    if t >= 0:
                        self._evict(layer, t)
                self._map(L, e, s)
        for p in range(1 if self.whole else L.n_proj):
            for i in range(n):
                if copy[i] and L.sch_first[i]:
                    self._queue_copy(layer, L.sch_e[i], L.sch_s[i], -1 if self.whole else p,
                                     priority, -1, 0)
            for i in range(n):
                if copy[i] and not L.sch_first[i]:
                    for q in (range(L.n_proj) if self.whole else (p,)):
                        self._queue_copy(layer, L.sch_e[i], L.sch_s[i], q, priority, i, need[i])
        for i in range(n):
            s = L.sch_s[i]
            if s >= L.n_slots:
                continue
            if not L.sch_first[i]:
                old = L.expert_of[s]
                if old >= 0 and L.slot_of.get(old) == s:
                    del L.slot_of[old]
                L.expert_of[s] = L.sch_e[i]
                L.slot_of[L.sch_e[i]] = s
                L.last_entry[s] = i
            L.in_use[s] = True
            self._stamp(L, s)  # a slot's last entry leaves the latest stamp
        self.in_use_layer = layer
        self._kick()
        return 0

    def layer_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        L = self.layers[layer]
        st = np.empty(L.n_slots, dtype=np.int32)
        for s in range(L.n_slots):
            if L.expert_of[s] < 0:
                st[s] = SLOT_EMPTY
            elif L.last_entry[s] >= 0:
                st[s] = SLOT_QUEUED if sum(L.entry_pend[L.last_entry[s]]) else SLOT_READY
            elif L.pending[s] == 0:
                st[s] = SLOT_READY
            else:
                st[s] = SLOT_COPYING if L.started[s] else SLOT_QUEUED
        return np.array(L.expert_of, dtype=np.int32), st

    def stage(self, layer: int, expert: int, priority: int) -> int:
        """Copy ``expert`` of ``layer`` into a free stage slot with ``priority``; the stage slot,
        or -1 when none is free (or ``expert`` has a slot of the layer or a stage slot)."""
        L = self.layers[layer]
        if expert in L.slot_of or any(o == (layer, expert) for o in self.stage_of):
            return -1
        j = next((j for j in range(self.n_stage) if self.stage_of[j] is None), -1)
        if j < 0:
            return -1
        self.stage_of[j] = (layer, expert)
        self.stage_started[j] = False
        self._queue_copy(layer, expert, L.n_slots + j, -1, priority, -1, 0)
        self.stats["staged"] += 1
        self._kick()
        return j

    def stage_slots(self) -> int:
        return self.n_stage

    def n_experts(self, layer: int) -> int:
        return self.shape.experts

    def staged(self, layer: int) -> dict[int, tuple[int, int]]:
        """Experts of ``layer`` in stage slots: expert -> (stage slot, SLOT_* state)."""
        out = {}
        for j, o in enumerate(self.stage_of):
            if o is not None and o[0] == layer:
                st = SLOT_READY if sum(self.stage_pend[j]) == 0 else \
                    SLOT_COPYING if self.stage_started[j] else SLOT_QUEUED
                out[o[1]] = (j, st)
        return out

    def host_resident(self, layer: int) -> set[int] | None:
        """With a disk tier, the experts of ``layer`` read into host slots; None without."""
        return None if self.disk is None else self.disk.resident(layer)

    def _staged_at(self, layer: int, expert: int, slot: int) -> bool:
        j = slot - self.layers[layer].n_slots
        return 0 <= j < self.n_stage and self.stage_of[j] == (layer, expert)

    def _release_stage(self, j: int) -> None:
        """Stage slot ``j`` is free again; its queued chunks go."""
        o = self.stage_of[j]
        if o is None:
            return
        slot = self.layers[o[0]].n_slots + j
        self._drop(0, o[0], lambda c: c.slot == slot, slot=slot)
        self.stage_of[j] = None
        self.stage_in_use[j] = False

    def release_layer_stage(self, layer: int) -> None:
        """Stage slots lent to ``layer`` that no schedule uses go back (a gate computed it
        without them)."""
        for j, o in enumerate(self.stage_of):
            if o is not None and o[0] == layer and not self.stage_in_use[j]:
                self._release_stage(j)

    def resident_order(self, layer: int) -> list[int]:
        L = self.layers[layer]
        return sorted((s for s in range(L.n_slots) if L.expert_of[s] >= 0),
                      key=lambda s: (L.key[L.expert_of[s]], L.stamp[s]))

    def set_keys(self, layer: int, keys: Sequence[int], step: int) -> None:
        L = self.layers[layer]
        if len(keys) != len(L.key):
            raise ValueError(f"layer {layer}: {len(keys)} keys for {len(L.key)} experts")
        L.key, L.key_step = [int(k) for k in keys], int(step)

    def add_keys(self, layer: int, experts: Sequence[int], deltas: Sequence[int]) -> None:
        L = self.layers[layer]
        for e, d in zip(experts, deltas, strict=True):
            L.key[int(e)] += int(d)

    def layer_keys(self, layer: int) -> np.ndarray:
        return np.array(self.layers[layer].key, dtype=np.int64)

    def touch(self, layer: int, experts: Sequence[int]) -> None:
        L = self.layers[layer]
        for e in experts:
            s = L.slot_of.get(int(e))
            if s is not None:
                self._stamp(L, s)

    def passes(self, layer: int) -> tuple[int, int]:
        return self.epoch, self.layers[layer].routed_pass

    def _stamp(self, L: _Layer, slot: int) -> None:
        self.clock += 1
        L.stamp[slot] = self.clock

    # -- what the C side does around the hook --------------------------------------------------
    def new_pass(self) -> None:
        """A graph compute starts (the node hook's start of graph)."""
        self.epoch += 1

    def begin_route(self, layer: int, experts: Sequence[int] = (),
                    rows: Sequence[int] | None = None) -> None:
        """fc_route before the hook: the previous layer is computed; forget this layer's plan;
        the slots of the routed ``experts`` (distinct, first use first; ``rows``: token rows of
        each, default 1) are used now and their eviction keys grow by the layer's step."""
        if self.in_use_layer >= 0:
            L = self.layers[self.in_use_layer]
            L.in_use = [False] * L.n_slots
            for j in range(self.n_stage):
                if self.stage_in_use[j]:
                    self._release_stage(j)
            self.in_use_layer = -1
        self._clear_schedule(layer)
        L = self.layers[layer]
        if L.key_step:
            for e, r in zip(experts, rows if rows is not None else [1] * len(experts),
                            strict=True):
                L.key[int(e)] += L.key_step * int(r)
        self.touch(layer, experts)
        L.routed_pass = self.epoch

    def default_schedule(self, layer: int, experts: Sequence[int]) -> bool:
        """No schedule from the policy: routed experts in first-use order from their slots."""
        L = self.layers[layer]
        slots = [L.slot_of.get(int(e), -1) for e in experts]
        return all(s >= 0 for s in slots) and self.schedule(layer, experts, slots, HIGH) == 0

    def end_route_host(self, layer: int) -> None:
        self._clear_schedule(layer)
        self.release_layer_stage(layer)
        L = self.layers[layer]
        L.in_use = [False] * L.n_slots

    def entry_ready(self, layer: int, i: int, p: int) -> bool:
        L = self.layers[layer]
        if L.sch_s[i] >= L.n_slots:
            return self.stage_pend[L.sch_s[i] - L.n_slots][p] == 0
        if L.sch_first[i]:
            return L.pend_proj[L.sch_s[i]][p] == 0
        return L.entry_pend[i][p] == 0

    def all_ready_proj(self, layer: int, p: int) -> bool:
        """Every slot entry of the schedule can be computed for projection ``p``."""
        return all(self.entry_ready(layer, i, p) for i in range(self.layers[layer].n_dev))

    def all_ready(self, layer: int) -> bool:
        L = self.layers[layer]
        return all(self.entry_ready(layer, i, p) for i in range(L.n_dev)
                   for p in range(L.n_proj))

    def consume(self, layer: int, entries: Sequence[int], p: int) -> None:
        L = self.layers[layer]
        for i in entries:
            if L.sch_s[i] < L.n_slots:
                L.consumed[L.sch_s[i]][p] += 1
                L.used[L.sch_s[i]] = True
        self._kick()

    # -- virtual time -------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], object]) -> None:
        """Run ``fn`` at virtual time ``t`` (a prediction arriving from the predictor thread)."""
        heapq.heappush(self._events, (t, next(self._seq), "call", fn))

    def post(self, t: float, kind: str, payload: object) -> None:
        """An event of ``kind`` at time ``t`` (the disk tier's: "disk")."""
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def advance_to(self, t: float) -> None:
        """Run every event up to time ``t``; the clock ends at ``t``."""
        while self._events and self._events[0][0] <= t:
            self._step()
        self.now = max(self.now, t)
        self._kick()

    def wait_until(self, cond: Callable[[], bool]) -> float:
        """Run events until ``cond`` holds; returns the time it first does."""
        while not cond():
            if not self._events:
                if self.disk is not None and self.disk.queued:
                    raise RuntimeError("simulated compute waits for reads that no host slot can "
                                       "take: every one is needed")
                raise RuntimeError("simulated compute waits for a copy that is never queued")
            self._step()
        return self.now

    def _step(self) -> None:
        t, _, kind, payload = heapq.heappop(self._events)
        self.now = max(self.now, t)
        if kind == "done":
            self._finish(payload)  # type: ignore[arg-type]
        elif kind == "disk":
            assert self.disk is not None
            self.disk.on_event(payload)  # type: ignore[arg-type]
        else:
            payload()  # type: ignore[operator]
        self._kick()

    def runnable_experts(self, layer: int) -> set[int]:
        """Experts of ``layer`` with a queued chunk that could run but for its read."""
        return {c.expert for q in self.queue for c in q
                if c.layer == layer and (c.need <= 0 or
                                         self.layers[layer].consumed[c.slot][c.proj] >= c.need)}

    def _runnable_priority(self, layer: int, expert: int) -> int | None:
        """The highest priority of a queued chunk of ``expert`` that could run but for its read
        (None: none could)."""
        for p, q in enumerate(self.queue):
            for c in q:
                if c.layer == layer and c.expert == expert and (
                        c.need <= 0 or self.layers[layer].consumed[c.slot][c.proj] >= c.need):
                    return p
        return None

    def _kick(self) -> None:
        if self.disk is not None and self.disk.orphans:
            self.disk.request_orphans(self._runnable_priority)
        if self.paused:
            return
        for bus in range(self.n_buses):
            if self.runs[bus] is None:
                self._start(bus)

    def _start(self, bus: int) -> None:
        """Start the next chunk over link ``bus``, if one can run."""
        ch = self._pop(bus)
        if ch is None:
            return
        L = self.layers[ch.layer]
        if ch.slot >= L.n_slots:
            self.stage_started[ch.slot - L.n_slots] = True
        elif ch.entry < 0:
            L.started[ch.slot] = True
        if ch.first and ch.priority == 0:
            w = self.now - ch.queued_at
            self.stats["hi_wait_s"] += w
            self.stats["hi_wait_max_s"] = max(self.stats["hi_wait_max_s"], w)
            # the part of the wait spent behind the last lower-priority chunk copying (a chunk
            # that waited for its slot to be consumed may see lower ones start after it was
            # queued), as fc_run counts it
            b = self.low_end - max(ch.queued_at, self.low_start)
            if b > 0:
                self.stats["hi_block_s"] += b
                self.stats["hi_block_max_s"] = max(self.stats["hi_block_max_s"], b)
        self.runs[bus] = ch
        if ch.priority > 0:
            self.low_start = self.now
        if self.disk is not None:
            self.disk.hold(ch.layer, ch.expert, +1, stamp=True)
        p = self.profile
        # a copy that starts while the CPU computes experts, or disk reads land, shares DRAM
        rate = p.h2d_gbps * p.dram_factor(
            copy=True, cpu=self.now < self.cpu_busy_until,
            disk=self.disk is not None and self.disk.flowing(),
            copies=sum(c is not None for c in self.runs))
        dur = p.chunk_latency_s + ch.size / (rate * 1e9)
        self.busy_until = self.now + dur
        heapq.heappush(self._events, (self.busy_until, next(self._seq), "done", ch))

    def _finish(self, ch: _Chunk) -> None:
        bus = self.bus_of[ch.layer]
        self.runs[bus] = None
        if ch.priority > 0:
            self.low_end = self.now
        if self.disk is not None:
            self.disk.hold(ch.layer, ch.expert, -1, stamp=False)
        self._count(ch, -1)
        self.stats["h2d_bytes"] += ch.size
        self.stats["n_chunks"] += 1
        if self.n_buses > 1:
            self.stats[f"h2d_bytes_dev{bus}"] += ch.size

    def _eligible(self, c: _Chunk) -> bool:
        if self.disk is not None and not self.disk.present(c.layer, c.expert):
            return False  # its expert is still on disk
        return c.need <= 0 or self.layers[c.layer].consumed[c.slot][c.proj] >= c.need

    def _pop(self, bus: int = 0) -> _Chunk | None:
        for q in self.queue:
            for c in q:
                if (self.n_buses == 1 or self.bus_of[c.layer] == bus) and self._eligible(c):
                    q.remove(c)
                    self._queued(c, -1)
                    return c
        return None

    def _queued(self, c: _Chunk, d: int) -> None:
        self._queued_layer[c.layer] += d
        key = (c.layer, c.slot)
        self._queued_slot[key] = self._queued_slot.get(key, 0) + d

    def _count(self, c: _Chunk, d: int) -> None:
        if self.disk is not None:  # a queued or running chunk keeps its expert's host slot
            self.disk.want(c.layer, c.expert, d)
        L = self.layers[c.layer]
        if c.slot >= L.n_slots:
            for p in (range(L.n_proj) if c.proj < 0 else (c.proj,)):
                self.stage_pend[c.slot - L.n_slots][p] += d
            return
        for p in (range(L.n_proj) if c.proj < 0 else (c.proj,)):
            if c.entry < 0:
                L.pend_proj[c.slot][p] += d
            else:
                L.entry_pend[c.entry][p] += d
        if c.entry < 0:
            L.pending[c.slot] += d

    def _queue_copy(self, layer: int, expert: int, slot: int, proj: int, priority: int,
                    entry: int, need: int) -> None:
        sizes = self.shape.proj_bytes
        if self.disk is not None:  # its expert is read first when missing (fc_queue_copy)
            self.disk.use(layer, expert, priority)
        if proj < 0 and self.whole:
            chunks = [(-1, sum(sizes))]
        else:
            chunks = [(p, sizes[p]) for p in (range(len(sizes)) if proj < 0 else (proj,))]
        for i, (p, size) in enumerate(chunks):
            c = _Chunk(layer, slot, p, expert, priority, entry, need, i == 0, size, self.now)
            self._count(c, +1)
            self._queued(c, +1)
            self.queue[priority].append(c)
        if priority == 0:
            self.stats["hi_tasks"] += 1

    def _drop(self, min_priority: int, layer: int, match: Callable[[_Chunk], bool],
              slot: int | None = None) -> int:
        """Drop the queued chunks of ``layer`` (of its ``slot``, if given) at ``min_priority``
        or lower that ``match``; returns the slots emptied."""
        if self._queued_layer[layer] == 0 or (
                slot is not None and self._queued_slot.get((layer, slot), 0) == 0):
            return 0
        emptied = set()
        stage = set()
        for p in range(max(min_priority, 0), N_PRIORITIES):
            keep: deque[_Chunk] = deque()
            for c in self.queue[p]:
                if c.layer != layer or not match(c):
                    keep.append(c)
                    continue
                L = self.layers[c.layer]
                self._count(c, -1)
                self._queued(c, -1)
                self.stats["dropped_chunks"] += 1
                if c.slot >= L.n_slots:
                    stage.add(c.slot - L.n_slots)
                elif c.entry < 0 or L.expert_of[c.slot] == c.expert:
                    emptied.add((c.layer, c.slot))
            self.queue[p] = keep
        for j in stage:  # a stage slot whose copy lost a chunk is free again
            self.stage_of[j] = None
            self.stage_in_use[j] = False
        for il, s in emptied:
            self._empty(self.layers[il], s)
        return len(emptied)

    def _clear_schedule(self, layer: int) -> None:
        L = self.layers[layer]
        if L.streams:
            self._drop(0, layer, lambda c: c.entry >= 0)
        L.last_entry = [-1] * L.n_slots
        for j, o in enumerate(self.stage_of):
            if o is not None and o[0] == layer:
                self.stage_in_use[j] = False
        L.sch_e, L.sch_s, L.sch_first = [], [], []
        L.streams = False
        L.n_dev = 0

    def _evict(self, layer: int, slot: int) -> None:
        """Empty ``slot`` of ``layer`` for another expert, its queued copies dropped; exclusive
        tiers write a copied expert leaving it back to a host slot if it was computed there
        (one only predicted, never used, is not worth a host slot)."""
        L = self.layers[layer]
        e = L.expert_of[slot]
        demote = e >= 0 and self.disk is not None and self.disk.exclusive and \
            L.slot_of.get(e) == slot and L.pending[slot] == 0 and L.last_entry[slot] < 0 and \
            L.used[slot]
        self._drop(0, layer, lambda c: c.slot == slot, slot=slot)
        self._empty(L, slot)
        if demote:
            assert self.disk is not None
            self.disk.demote(layer, e)

    @staticmethod
    def _empty(L: _Layer, slot: int) -> None:
        e = L.expert_of[slot]
        if e >= 0 and L.slot_of.get(e) == slot:
            del L.slot_of[e]
        L.expert_of[slot] = -1
        L.last_entry[slot] = -1

    @staticmethod
    def _map(L: _Layer, expert: int, slot: int) -> None:
        L.expert_of[slot] = expert
        L.slot_of[expert] = slot
        L.started[slot] = False
        L.used[slot] = False


