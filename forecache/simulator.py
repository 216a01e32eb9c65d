"""Trace-driven simulation of an expert-cache policy on a modelled machine.

A trace is replayed ubatch by ubatch (prefill rows in ubatches of ``n_ubatch``, decode rows one
at a time) through the SAME policy (``cache.policies`` / ``cache.prefetcher``) and predictor
(``cache.forecast``) code the runtime runs. What is modelled is what the runtime leaves to
llama.cpp and the C expert cache: compute time (``sim_profile`` roofline) and the copy engine,
``SimEngine``, which follows the C engine's contract (one worker, chunks highest priority first,
streamed copies that wait for their slot's previous expert, the in-use guard). Virtual time only:
the result depends on the trace, shape, profile and options, never on this machine.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from forecache.cache.forecast import Forecaster
from forecache.cache.policies import LRUPolicy, Policy, StaticPolicy
from forecache.cache.prefetcher import (
    HIGH,
    SLOT_COPYING,
    SLOT_EMPTY,
    SLOT_QUEUED,
    SLOT_READY,
    Features,
    Prefetcher,
)
from forecache.cache.split import CostModel
from forecache.predictor.base import Predictor, Request
from forecache.sim_profile import Profile, SimShape

N_PRIORITIES = 4
SIM_POLICIES = ("offload", "lru", "static", "promoe")


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


class SimEngine:
    """The C copy engine's contract in virtual time (see include/forecache.h, patch 0004)."""

    def __init__(self, shape: SimShape, n_slots: Sequence[int], profile: Profile, *,
                 whole_expert_chunks: bool = False) -> None:
        self.shape = shape
        self.profile = profile
        self.whole = whole_expert_chunks
        n_proj = len(shape.proj_bytes)
        self.layers = [_Layer(n, n_proj, [-1] * n, pending=[0] * n,
                              pend_proj=[[0] * n_proj for _ in range(n)], started=[False] * n,
                              in_use=[False] * n, last_entry=[-1] * n) for n in n_slots]
        self.queue: list[deque[_Chunk]] = [deque() for _ in range(N_PRIORITIES)]
        self.now = 0.0
        self.busy_until = 0.0
        self.running: _Chunk | None = None
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.in_use_layer = -1
        self.paused = False  # as forecache_cache_pause: no copy starts
        self.low_end = float("-inf")  # when the last lower-priority chunk finished
        self.stats = {"h2d_bytes": 0, "n_chunks": 0, "hi_wait_s": 0.0, "hi_wait_max_s": 0.0,
                      "hi_tasks": 0, "dropped_chunks": 0, "refused_loads": 0, "streamed": 0,
                      "host_entries": 0, "hi_block_s": 0.0, "hi_block_max_s": 0.0}

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
                self._drop(0, lambda c, s=s: c.layer == layer and c.slot == s)
                self._empty(L, s)
        self._map(L, expert, slot)
        self._queue_copy(layer, expert, slot, -1, priority, -1, 0)
        self._kick()
        return 0

    def preempt(self, layer: int, keep: Sequence[int]) -> int:
        wanted = set(int(e) for e in keep)
        for p in range(1, N_PRIORITIES):
            moved = [c for c in self.queue[p]
                     if c.layer == layer and c.entry < 0 and c.expert in wanted]
            for c in moved:
                self.queue[p].remove(c)
                if c.first:
                    c.queued_at = self.now
                    self.stats["hi_tasks"] += 1
                c.priority = 0
                self.queue[0].append(c)
        n = self._drop(1, lambda c: c.layer == layer and c.entry < 0)
        self._kick()
        return n

    def schedule(self, layer: int, experts: Sequence[int], slots: Sequence[int],
                 priority: int) -> int:
        L = self.layers[layer]
        n = len(experts)
        n_dev = next((i for i, s in enumerate(slots) if s < 0), n)  # host entries from there on
        if (n == 0 or len(set(experts)) != n or any(not 0 <= s < L.n_slots for s in slots[:n_dev])
                or any(s != -1 for s in slots[n_dev:])):
            return -1
        self._clear_schedule(layer)
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
                        self._drop(0, lambda c, t=t: c.layer == layer and c.slot == t)
                        self._empty(L, t)
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
            if not L.sch_first[i]:
                old = L.expert_of[s]
                if old >= 0 and L.slot_of.get(old) == s:
                    del L.slot_of[old]
                L.expert_of[s] = L.sch_e[i]
                L.slot_of[L.sch_e[i]] = s
                L.last_entry[s] = i
            L.in_use[s] = True
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

    # -- what the C side does around the hook --------------------------------------------------
    def begin_route(self, layer: int) -> None:
        """fc_route before the hook: the previous layer is computed; forget this layer's plan."""
        if self.in_use_layer >= 0:
            L = self.layers[self.in_use_layer]
            L.in_use = [False] * L.n_slots
            self.in_use_layer = -1
        self._clear_schedule(layer)

    def default_schedule(self, layer: int, experts: Sequence[int]) -> bool:
        """No schedule from the policy: routed experts in first-use order from their slots."""
        L = self.layers[layer]
        slots = [L.slot_of.get(int(e), -1) for e in experts]
        return all(s >= 0 for s in slots) and self.schedule(layer, experts, slots, HIGH) == 0

    def end_route_host(self, layer: int) -> None:
        self._clear_schedule(layer)
        L = self.layers[layer]
        L.in_use = [False] * L.n_slots

    def entry_ready(self, layer: int, i: int, p: int) -> bool:
        L = self.layers[layer]
        if L.sch_first[i]:
            return L.pend_proj[L.sch_s[i]][p] == 0
        return L.entry_pend[i][p] == 0

    def all_ready(self, layer: int) -> bool:
        L = self.layers[layer]
        return all(self.entry_ready(layer, i, p) for i in range(L.n_dev)
                   for p in range(L.n_proj))

    def consume(self, layer: int, entries: Sequence[int], p: int) -> None:
        L = self.layers[layer]
        for i in entries:
            L.consumed[L.sch_s[i]][p] += 1
        self._kick()

    # -- virtual time -------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], object]) -> None:
        """Run ``fn`` at virtual time ``t`` (a prediction arriving from the predictor thread)."""
        heapq.heappush(self._events, (t, next(self._seq), "call", fn))

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
                raise RuntimeError("simulated compute waits for a copy that is never queued")
            self._step()
        return self.now

    def _step(self) -> None:
        t, _, kind, payload = heapq.heappop(self._events)
        self.now = max(self.now, t)
        if kind == "done":
            self._finish(payload)  # type: ignore[arg-type]
        else:
            payload()  # type: ignore[operator]
        self._kick()

    def _kick(self) -> None:
        if self.running is not None or self.paused:
            return
        ch = self._pop()
        if ch is None:
            return
        L = self.layers[ch.layer]
        if ch.entry < 0:
            L.started[ch.slot] = True
        if ch.first and ch.priority == 0:
            w = self.now - ch.queued_at
            self.stats["hi_wait_s"] += w
            self.stats["hi_wait_max_s"] = max(self.stats["hi_wait_max_s"], w)
            b = self.low_end - ch.queued_at  # behind a lower-priority chunk already copying
            if b > 0:
                self.stats["hi_block_s"] += b
                self.stats["hi_block_max_s"] = max(self.stats["hi_block_max_s"], b)
        self.running = ch
        dur = self.profile.chunk_latency_s + ch.size / (self.profile.h2d_gbps * 1e9)
        self.busy_until = self.now + dur
        heapq.heappush(self._events, (self.busy_until, next(self._seq), "done", ch))

    def _finish(self, ch: _Chunk) -> None:
        self.running = None
        if ch.priority > 0:
            self.low_end = self.now
        self._count(ch, -1)
        self.stats["h2d_bytes"] += ch.size
        self.stats["n_chunks"] += 1

    def _eligible(self, c: _Chunk) -> bool:
        return c.need <= 0 or self.layers[c.layer].consumed[c.slot][c.proj] >= c.need

    def _pop(self) -> _Chunk | None:
        for q in self.queue:
            for c in q:
                if self._eligible(c):
                    q.remove(c)
                    return c
        return None

    def _count(self, c: _Chunk, d: int) -> None:
        L = self.layers[c.layer]
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
        if proj < 0 and self.whole:
            chunks = [(-1, sum(sizes))]
        else:
            chunks = [(p, sizes[p]) for p in (range(len(sizes)) if proj < 0 else (proj,))]
        for i, (p, size) in enumerate(chunks):
            c = _Chunk(layer, slot, p, expert, priority, entry, need, i == 0, size, self.now)
            self._count(c, +1)
            self.queue[priority].append(c)
        if priority == 0:
            self.stats["hi_tasks"] += 1

    def _drop(self, min_priority: int, match: Callable[[_Chunk], bool]) -> int:
        emptied = set()
        for p in range(max(min_priority, 0), N_PRIORITIES):
            keep: deque[_Chunk] = deque()
            for c in self.queue[p]:
                if not match(c):
                    keep.append(c)
                    continue
                L = self.layers[c.layer]
                self._count(c, -1)
                self.stats["dropped_chunks"] += 1
                if c.entry < 0 or L.expert_of[c.slot] == c.expert:
                    emptied.add((c.layer, c.slot))
            self.queue[p] = keep
        for il, s in emptied:
            self._empty(self.layers[il], s)
        return len(emptied)

    def _clear_schedule(self, layer: int) -> None:
        L = self.layers[layer]
        if L.streams:
            self._drop(0, lambda c: c.layer == layer and c.entry >= 0)
        L.last_entry = [-1] * L.n_slots
        L.sch_e, L.sch_s, L.sch_first = [], [], []
        L.streams = False
        L.n_dev = 0

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


@dataclass
class SimConfig:
    """One simulated run: policy, cache size, promoe's options and the ubatch size."""

    policy: str
    n_slots: int  # per MoE layer with data
    features: Features = field(default_factory=Features)
    window: int = 2
    n_ubatch: int = 512
    static_profile: np.ndarray | None = None  # static: routed counts [L, E]


@dataclass
class SimResult:
    ttft_s: float
    tpot_s: float
    prefill_s: float
    decode_s: float
    n_prefill_tokens: int
    n_decode_tokens: int
    hits: int
    misses: int
    host_layers: int
    h2d_bytes: int
    stall_s: float  # compute waiting for copies: loading time on the critical path
    hook_s: float
    extra: dict
    per_layer: list[dict]

    def to_json(self) -> dict:
        routed = self.hits + self.misses
        out = {k: v for k, v in self.__dict__.items() if k not in ("extra", "per_layer")}
        out.update(self.extra)
        out["hit_rate"] = self.hits / routed if routed else 0.0
        out["per_layer"] = self.per_layer
        return out


class Simulator:
    """Replays requests of a trace through a policy on the modelled machine."""

    def __init__(self, shape: SimShape, profile: Profile, cfg: SimConfig, layers: Sequence[int],
                 predictor: Predictor | None = None) -> None:
        self.shape, self.profile, self.cfg = shape, profile, cfg
        self.layers = list(layers)  # trace layers with routing data, simulated as cached layers
        n_layers = shape.layers
        self.n_slots = [0] * n_layers
        for il in self.layers:
            self.n_slots[il] = min(cfg.n_slots, shape.experts)
        f = cfg.features
        self.engine = SimEngine(shape, self.n_slots, profile, whole_expert_chunks=not f.chunk)
        self.policy: Policy | None
        if cfg.policy == "lru":
            self.policy = LRUPolicy(self.n_slots)
        elif cfg.policy == "static":
            if cfg.static_profile is None:
                raise ValueError("the static policy needs a routing profile")
            self.policy = StaticPolicy(self.n_slots, cfg.static_profile)
        elif cfg.policy == "promoe":
            self.policy = Prefetcher(self.n_slots, f, CostModel.from_profile(profile, shape.expert))
        elif cfg.policy == "offload":
            self.policy = None
        else:
            raise ValueError(f"unknown policy {cfg.policy!r}; simulate one of "
                             f"{', '.join(SIM_POLICIES)}")
        self.forecaster = None
        if cfg.policy == "promoe" and f.prefetch and predictor is not None:
            self.forecaster = Forecaster(predictor, cfg.window, self.layers, self.n_slots)
        if self.policy is not None:
            for il, e, s in self.policy.initial_loads():
                self.engine.load(il, e, s, 1)
            self.engine.wait_until(lambda: self.engine.running is None and
                                   not any(self.engine.queue))
            self.engine.stats.update(h2d_bytes=0, n_chunks=0)
        self.t = self.engine.now
        self._merge = CostModel.from_profile(profile, shape.expert)  # host entries' merge time
        self._hook_s = profile.prefetch_hook_s if cfg.policy == "promoe" and \
            profile.prefetch_hook_s > 0 else profile.hook_s
        self.hits = self.misses = self.host_layers = 0
        self.stall = self.hook = 0.0
        L = n_layers
        self.lay = {k: np.zeros(L) for k in ("predicted", "correct", "in_time", "good", "stall")}
        self._pred: dict[int, tuple[int, np.ndarray]] = {}  # layer -> (pass, predicted)

    # -- timing model -------------------------------------------------------------------------
    def _dev(self, nbytes: float, flops: float) -> float:
        p = self.profile
        return p.gpu_launch_s + max(nbytes / (p.gpu_mem_gbps * 1e9), flops / (p.gpu_tflops * 1e12))

    def _host(self, nbytes: float, flops: float) -> float:
        p = self.profile
        return p.cpu_launch_s + max(nbytes / (p.cpu_mem_gbps * 1e9), flops / (p.cpu_gflops * 1e9))

    def _node(self, experts: Sequence[int], rows: int, p: int) -> float:
        sh = self.shape
        return self._dev(len(experts) * sh.proj_bytes[p], rows * sh.proj_flops)

    # -- replay -------------------------------------------------------------------------------
    def run_request(self, req: Request) -> tuple[float, list[float]]:
        """Simulate one request; returns (prefill seconds, per-decode-token seconds)."""
        phase = req.phase if req.phase is not None else np.ones(req.n_tokens, np.int8)
        if self.forecaster is not None:
            self.forecaster.begin_request()
        prefill_rows = np.flatnonzero(phase == 0)
        prefill = 0.0
        for i in range(0, len(prefill_rows), self.cfg.n_ubatch):
            prefill += self._ubatch(req, prefill_rows[i:i + self.cfg.n_ubatch])
        decode = [self._ubatch(req, np.array([r])) for r in np.flatnonzero(phase != 0)]
        if self.forecaster is not None:
            self.forecaster.end_request()
        return prefill, decode

    def _ubatch(self, req: Request, rows: np.ndarray) -> float:
        sh, eng, n = self.shape, self.engine, len(rows)
        t0 = self.t
        cached = set(self.layers)
        for il in range(sh.layers):
            self.t += self._dev(sh.layer_bytes, n * sh.layer_flops)
            eng.advance_to(self.t)
            if il not in cached:
                self.t += self._dev(sh.top_k * sh.expert_bytes, n * sh.top_k * 3 * sh.proj_flops)
                continue
            ids = req.experts[rows, il].astype(np.int64)
            known = ids[ids >= 0]
            if known.size == 0:
                continue
            uniq, first, counts = np.unique(known, return_index=True, return_counts=True)
            by_use = np.argsort(first, kind="stable")
            experts, counts = uniq[by_use], counts[by_use]
            self._account_prediction(il, experts)
            if self.policy is None:
                self.t += self._host_layer(experts, known.size)
                continue
            eng.begin_route(il)
            L = eng.layers[il]
            for e in experts.tolist():
                if e in L.slot_of:
                    self.hits += 1
                else:
                    self.misses += 1
            self.t += self._hook_s
            self.hook += self._hook_s
            eng.advance_to(self.t)
            on_slots = self.policy.gate(il, experts, eng, counts)
            if on_slots and not L.sch_e:
                on_slots = eng.default_schedule(il, experts.tolist())
            if self.forecaster is not None:
                self._forecast(il, ids, req, rows)
            if on_slots and L.streams and not self.cfg.features.reorder:
                on_slots = False
            if not on_slots:
                eng.end_route_host(il)
                self.host_layers += 1
                self.t += self._host_layer(experts, known.size)
                eng.advance_to(self.t)
                continue
            self._slot_compute(il, ids)
        self.t += self._dev(sh.head_bytes, 2.0 * sh.head_bytes / sh.bytes_per_weight)
        self.t += self.profile.token_s
        eng.advance_to(self.t)
        return self.t - t0

    def _host_layer(self, experts: np.ndarray, pairs: int) -> float:
        sh = self.shape
        return sum(self._host(len(experts) * sh.proj_bytes[p], pairs * sh.proj_flops)
                   for p in range(len(sh.proj_bytes)))

    def _wait(self, il: int, cond: Callable[[], bool]) -> None:
        if cond():
            return
        t = self.engine.wait_until(cond)
        if t > self.t:
            self.stall += t - self.t
            self.lay["stall"][il] += t - self.t
            self.t = t

    def _slot_compute(self, il: int, ids: np.ndarray) -> None:
        eng = self.engine
        L = eng.layers[il]
        rows_of = {e: int((ids == e).sum()) for e in L.sch_e}
        n = L.n_dev
        on_host = L.sch_e[n:]
        host_rows = sum(rows_of[e] for e in on_host)
        sh = self.shape
        if not self.cfg.features.reorder or self.cfg.policy != "promoe":
            # as the C side without reordering: wait for every slot, then each projection once
            self._wait(il, lambda: eng.all_ready(il))
            for p in range(L.n_proj):
                dev = self._node(L.sch_e[:n], sum(rows_of[e] for e in L.sch_e[:n]), p)
                if on_host:  # computed meanwhile on the CPU, then written into the result
                    host = self._host(len(on_host) * sh.proj_bytes[p], host_rows * sh.proj_flops)
                    dev = max(dev, host) + self._merge.merge_proj_s(host_rows)
                self.t += dev
            eng.advance_to(self.t)
            for p in range(L.n_proj):
                eng.consume(il, range(n), p)
            return
        for p in range(L.n_proj):
            host_end = self.t + self._host(len(on_host) * sh.proj_bytes[p],
                                           host_rows * sh.proj_flops) if on_host else self.t
            i = 0
            while i < n:
                self._wait(il, lambda i=i, p=p: eng.entry_ready(il, i, p))
                j = i + 1
                while j < n and eng.entry_ready(il, j, p):
                    j += 1
                group = L.sch_e[i:j]
                self.t += self._node(group, sum(rows_of[e] for e in group), p) + \
                    self.profile.group_s
                eng.advance_to(self.t)
                eng.consume(il, range(i, j), p)
                i = j
            if on_host:
                self.t = max(self.t, host_end) + self._merge.merge_proj_s(host_rows)
                eng.advance_to(self.t)

    def _forecast(self, il: int, ids: np.ndarray, req: Request, rows: np.ndarray) -> None:
        assert self.forecaster is not None and isinstance(self.policy, Prefetcher)
        hidden = None
        if self.forecaster.needs_hidden and req.gate_input is not None:
            hidden = np.asarray(req.gate_input[rows, il], dtype=np.float32)
        toks = None if req.token_ids is None else np.asarray(req.token_ids[rows])
        pass_id = self.policy.pass_id
        policy, eng = self.policy, self.engine
        t = self.t
        for target, experts in self.forecaster.on_gate(il, ids, hidden, toks):
            t += self.profile.predictor_s
            self._pred[target] = (pass_id, experts)
            eng.at(t, lambda target=target, experts=experts:
                   policy.prefetch(target, experts.tolist(), pass_id, eng))

    def _account_prediction(self, il: int, routed: np.ndarray) -> None:
        """ACCURACY, FETCHRATE and GOODPRED (ProMoE §4.1) of the prediction made for ``il``."""
        got = self._pred.pop(il, None)
        if got is None or not isinstance(self.policy, Prefetcher):
            return
        _, predicted = got
        expert_of, state = self.engine.layer_state(il)
        ready = {int(e) for e, s in zip(expert_of.tolist(), state.tolist(), strict=True)
                 if s == SLOT_READY}
        routed_set = set(routed.tolist())
        for e in predicted.tolist():
            self.lay["predicted"][il] += 1
            self.lay["correct"][il] += e in routed_set
            self.lay["in_time"][il] += e in ready
            self.lay["good"][il] += e in routed_set and e in ready

    def result(self, prefill: list[float], decode: list[float], n_prefill: int) -> SimResult:
        eng = self.engine
        per_layer = []
        for il in self.layers:
            p = self.lay["predicted"][il]
            per_layer.append({
                "layer": il, "stall_s": float(self.lay["stall"][il]),
                "accuracy": float(self.lay["correct"][il] / p) if p else None,
                "fetchrate": float(self.lay["in_time"][il] / p) if p else None,
                "goodpred": float(self.lay["good"][il] / p) if p else None,
            })
        n_req = max(len(prefill), 1)
        extra = {k: v for k, v in eng.stats.items() if k != "h2d_bytes"}
        if isinstance(self.policy, Prefetcher):
            extra.update(prefetch_loads=self.policy.prefetch_loads,
                         stale_predictions=self.policy.stale_predictions)
        return SimResult(
            ttft_s=sum(prefill) / n_req, tpot_s=float(np.mean(decode)) if decode else 0.0,
            prefill_s=sum(prefill), decode_s=float(sum(decode)), n_prefill_tokens=n_prefill,
            n_decode_tokens=len(decode), hits=self.hits, misses=self.misses,
            host_layers=self.host_layers, h2d_bytes=int(eng.stats["h2d_bytes"]),
            stall_s=self.stall, hook_s=self.hook, extra=extra, per_layer=per_layer)


def simulate(requests: Sequence[Request], shape: SimShape, profile: Profile, cfg: SimConfig,
             predictor: Predictor | None = None) -> SimResult:
    """Replay ``requests`` (in order, one at a time) and summarise."""
    if not requests:
        raise ValueError("no requests to simulate")
    layers = [il for il in range(shape.layers)
              if any((r.experts[:, il] >= 0).any() for r in requests)]
    sim = Simulator(shape, profile, cfg, layers, predictor)
    prefill, decode = [], []
    n_prefill = 0
    for req in requests:
        p, d = sim.run_request(req)
        if req.phase is not None and (req.phase == 0).any():
            prefill.append(p)
            n_prefill += int((req.phase == 0).sum())
        decode.extend(d)
    return sim.result(prefill, decode, n_prefill)
