"""The proactive policy (ProMoE §5): early preemption, cache-first reordering, slot streaming and
prediction-driven prefetch, over a copy engine.

The copy engine is the C expert cache at run time (``ExpertCache``) and the simulator's model of it
(``simulator.SimEngine``); both run this same code. Priorities: HIGH for the exact misses of the
layer being routed, LOW for predicted experts of layers ahead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from forecache.cache.cost import CostModel
from forecache.cache.policies import Policy
from forecache.native.cache_api import (  # noqa: F401  (re-exported for the simulator)
    HIGH,
    LOW,
    SLOT_COPYING,
    SLOT_EMPTY,
    SLOT_QUEUED,
    SLOT_READY,
)


class CopyEngine(Protocol):
    """What a policy drives: slot loads, preemption, the compute schedule and slot states."""

    def load(self, layer: int, expert: int, slot: int, priority: int) -> int:
        """Queue ``expert`` into ``slot``; 0, 1 if the slot is in use (nothing changes)."""
        ...

    def preempt(self, layer: int, keep: Sequence[int]) -> int:
        """Queued low-priority copies of ``layer``: those of ``keep`` become high, others go."""
        ...

    def schedule(self, layer: int, experts: Sequence[int], slots: Sequence[int],
                 priority: int) -> int:
        """Compute order of the layer being routed, with the slot of each expert."""
        ...

    def layer_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(expert per slot, -1 empty; state per slot, SLOT_*)."""
        ...


@dataclass(frozen=True)
class Features:
    """The ProMoE techniques, each switchable for the ablation."""

    prefetch: bool = True  # predicted experts are copied ahead (sliding window)
    chunk: bool = True  # copies are split per expert projection (else one task per expert)
    preempt: bool = True  # at the gate, queued predictions of the layer give way to its misses
    reorder: bool = True  # experts computed cache-first; more experts than slots stream through
    split: bool = True  # missing experts cheaper on the CPU than over the bus are computed there

    def label(self) -> str:
        off = [name for name in ("prefetch", "chunk", "preempt", "reorder", "split")
               if not getattr(self, name)]
        return "promoe" + "".join(f" --no-{n}" for n in off)


# ProMoE's ablation ladder: each row adds one mechanism to the one before.
ABLATION = [("base (lru)", "lru", Features()),
            ("+prefetch", "promoe", Features(chunk=False, preempt=False, reorder=False,
                                             split=False)),
            ("+chunked", "promoe", Features(preempt=False, reorder=False, split=False)),
            ("+early preemption", "promoe", Features(reorder=False, split=False)),
            ("+reordered", "promoe", Features(split=False)),
            ("+host split", "promoe", Features())]


class Prefetcher(Policy):
    """Slot assignment for ``promoe``: a mirror of each layer's slots with recency, refreshed from
    the engine at every gate, shared by the gate hook and the prediction worker (one lock)."""

    name = "promoe"

    def __init__(self, n_slots: Sequence[int], features: Features = Features(),
                 cost: CostModel | None = None) -> None:
        super().__init__(n_slots)
        self.features = features
        self.cost = cost if features.split else None  # no cost model: every expert uses a slot
        self.lock = threading.Lock()
        # per layer: expert -> slot, oldest first (the eviction order)
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in self.n_slots]
        self.pass_id = 0  # forward passes (ubatches) seen
        self._last_layer = -1
        self._routed: list[int] = [-1] * len(self.n_slots)  # pass in which each layer was routed
        self.prefetch_loads = 0
        self.prefetch_refreshed = 0
        self.stale_predictions = 0

    # -- gate: the layer being computed --------------------------------------------------------
    def gate(self, layer: int, experts: np.ndarray, engine: CopyEngine,
             counts: np.ndarray | None = None) -> bool:
        """Route ``layer`` (distinct experts, first use first; ``counts``: token rows of each):
        True to compute from slots (and the host, for the experts the split sends there)."""
        f = self.features
        n = self.n_slots[layer]
        with self.lock:
            if layer <= self._last_layer:
                self.pass_id += 1
            self._last_layer = layer
            self._routed[layer] = self.pass_id
            need = [int(e) for e in experts.tolist()]
            if f.preempt:
                engine.preempt(layer, need)
            expert_of, state = engine.layer_state(layer)
            lru, where = self._sync(layer, expert_of)
            if f.reorder:
                rank = {SLOT_READY: 0, SLOT_COPYING: 1, SLOT_QUEUED: 2}
                order = sorted(need, key=lambda e: rank[int(state[where[e]])] if e in where else 3)
            else:
                order = sorted(need)  # the frameworks' expert-id order
            host: list[int] = []
            if self.cost is not None and counts is not None:
                rows = [(e, int(r), e in where) for e, r in zip(need, counts.tolist(), strict=True)]
                in_flight = sum(1 for e in need if e in where and state[where[e]] != SLOT_READY)
                plan = self.cost.plan(rows, in_flight)
                if plan.whole_layer:
                    # all on the CPU: cheaper than any use of the slots now. As many missing
                    # experts as can be copied while the CPU computes the layer still enter the
                    # cache (a cold cache would stay cold); more would hold up the next layers.
                    hidden = int(plan.host_s // self.cost.copy_s())
                    free = [s for s in range(n) if expert_of[s] < 0]
                    victims = free + self.eviction_order(layer, set(need))
                    for e in [e for e in need if e not in where][:hidden]:
                        if not victims or engine.load(layer, e, victims[0], LOW) != 0:
                            break
                        _put(lru, e, victims.pop(0))
                    return False
                host = plan.host
                if host:
                    on_host = set(host)
                    order = [e for e in order if e not in on_host]
            if len(order) > n and not f.reorder:
                return False  # cannot stream without reordered compute: from host memory
            needed = set(need)
            for e in need:
                if e in lru:
                    lru.move_to_end(e)
            free = [s for s in range(n) if expert_of[s] < 0]
            victims = free + self.eviction_order(layer, needed)
            slots: list[int] = []
            for i, e in enumerate(order):
                if i >= n:
                    slots.append(slots[i - n])  # streams through the slot computed longest ago
                elif e in where:
                    slots.append(where[e])
                else:
                    slots.append(victims.pop(0))
            if engine.schedule(layer, order + host, slots + [-1] * len(host), HIGH) != 0:
                return False
            # experts computed on the host still enter the cache, behind this layer's copies, in
            # slots the schedule does not use: the cache keeps following the routing
            for e in host:
                if not victims or engine.load(layer, e, victims[0], LOW) != 0:
                    break
                _put(lru, e, victims.pop(0))
            # the slot table at the end of the layer: the last expert scheduled into each slot
            final = {s: e for e, s in zip(order, slots, strict=True)}
            for s, e in final.items():
                old = int(expert_of[s])
                if old >= 0 and old != e:
                    lru.pop(old, None)
            for e, s in zip(order, slots, strict=True):
                if final[s] == e:
                    lru.pop(e, None)
                    lru[e] = s
            return True

    # -- prefetch: a layer ahead ---------------------------------------------------------------
    def prefetch(self, layer: int, experts: Sequence[int], pass_id: int,
                 engine: CopyEngine) -> int:
        """Queue predicted ``experts`` of ``layer`` (best first) at low priority; a resident one
        only refreshes its recency. Predictions for a layer already routed in ``pass_id`` (or of an
        older pass) are stale and dropped. Returns the copies queued."""
        if not self.features.prefetch or self.n_slots[layer] == 0:
            return 0
        with self.lock:
            if pass_id != self.pass_id or self._routed[layer] == pass_id:
                self.stale_predictions += 1
                return 0
            lru = self._lru[layer]
            picked = [int(e) for e in experts][:self.n_slots[layer]]
            for e in reversed(picked):  # best ends most recent
                if e in lru:
                    lru.move_to_end(e)
                    self.prefetch_refreshed += 1
            victims = self.prefetch_victims(layer, picked)
            queued = 0
            for e in picked:
                if e in lru or not victims:
                    continue
                s = victims.pop(0)
                if engine.load(layer, e, s, LOW) != 0:
                    break  # the layer is being computed: too late for the rest
                _put(lru, e, s)
                queued += 1
            self.prefetch_loads += queued
            return queued

    def prefetch_victims(self, layer: int, picked: list[int]) -> list[int]:
        """Slots a prefetch of ``picked`` (best first) may fill, in order: free slots, then the
        eviction order of the others (called with the lock held)."""
        used = set(self._lru[layer].values())
        free = [s for s in range(self.n_slots[layer]) if s not in used]
        return free + self.eviction_order(layer, set(picked))

    def eviction_order(self, layer: int, keep: set[int]) -> list[int]:
        """Slots of ``layer``'s resident experts outside ``keep``, the first to give up first:
        least recently used first (called with the lock held)."""
        return [s for e, s in self._lru[layer].items() if e not in keep]

    def _sync(self, layer: int, expert_of: np.ndarray
              ) -> tuple[OrderedDict[int, int], dict[int, int]]:
        """Make the mirror of ``layer`` agree with the engine (preemption empties slots); returns
        it and the engine's expert -> slot."""
        lru = self._lru[layer]
        actual = {e: s for s, e in enumerate(expert_of.tolist()) if e >= 0}
        for e in [e for e, s in lru.items() if actual.get(e) != s]:
            del lru[e]
        for e, s in actual.items():
            if e not in lru:
                lru[e] = s
                lru.move_to_end(e, last=False)  # unknown to the mirror: oldest
        return lru, actual


def _put(lru: OrderedDict[int, int], expert: int, slot: int) -> None:
    """``expert`` now holds ``slot`` (most recent); whoever held the slot is gone."""
    for old in [e for e, s in lru.items() if s == slot]:
        del lru[old]
    lru[expert] = slot
