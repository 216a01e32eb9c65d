"""The proactive policy (ProMoE §5): early preemption, cache-first reordering, slot streaming and
prediction-driven prefetch, over a copy engine.

The copy engine is the C expert cache at run time (``ExpertCache``) and the simulator's model of it
(``simulator.SimEngine``); both run this same code. Priorities: HIGH for the exact misses of the
layer being routed, LOW for predicted experts of layers ahead.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from forecache.cache.cost import CostModel, Row
from forecache.cache.policies import CopyEngine, Policy, PolicyInputs
from forecache.native.cache_api import (  # noqa: F401  (re-exported for the simulator)
    HIGH,
    LOW,
    SLOT_COPYING,
    SLOT_EMPTY,
    SLOT_QUEUED,
    SLOT_READY,
)


@dataclass(frozen=True)
class Features:
    """The ProMoE techniques, each switchable for the ablation."""

    prefetch: bool = True  # predicted experts are copied ahead (sliding window)
    chunk: bool = True  # copies are split per expert projection (else one task per expert)
    preempt: bool = True  # at the gate, queued predictions of the layer give way to its misses
    reorder: bool = True  # experts computed cache-first; more experts than slots stream through
    split: bool = True  # missing experts cheaper on the CPU than over the bus are computed there
    # the split also for ubatches of cost.DEVICE_MIN_TOKENS tokens or more (off: such a ubatch, a
    # prompt's, computes every expert on the device, as llama.cpp's op offload does;
    # CostModel.splits)
    prompt_split: bool = False
    # for ubatches of cost.DEVICE_MIN_TOKENS tokens or more, an expert group of fewer than this
    # many entries waits for more of the layer's copies to land, while they can (0: off; each
    # group is a graph of its own: fewer, larger groups cost fewer launches and syncs, and the
    # wait delays the experts in place: forecache_cache_set_gather)
    prompt_gather: int = 0

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


MAX_STAGE_SLOTS = 32


def stage_slots(n_expert: int, n_slots: Sequence[int], *, streams: bool,
                given: int | None = None, on_cpu: bool = False) -> int:
    """The stage slots a placement holds back for prompt passes (``CopyEngine.stage``), the one
    rule the runtime, the batch planner and the simulator follow. None unless the policy
    ``streams`` a prompt's misses through them (proactive, cache-first order); ``given`` where a
    count was stated; none by default ``on_cpu`` (a CPU build's slots are host memory too). Else
    as many as a layer misses: a layer of a long prompt routes every expert and misses
    ``n_expert - slots`` of them, half the stage slots take the next layer's misses while the
    other half serve the layer being computed; at most 32 and a 64th of the slots, whose memory
    they take, which decode misses (BENCHMARKS.md: at the target 18 take prefill from 1.42x to
    1.11x of its floor for 1.5% of decode)."""
    if not streams or given is None and on_cpu:
        return 0
    if given is not None:
        return given
    cached = [n for n in n_slots if n > 0]
    if not cached:
        return 0
    return max(0, min(n_expert - min(cached), MAX_STAGE_SLOTS, sum(cached) // 64))


class ProMoEPolicy(Policy):
    """Slot assignment for ``promoe``. Slot contents and recency live in the copy engine (the C
    cache or the simulator's), read at every gate and prediction; one lock keeps the gate hook
    and the prediction worker from interleaving their decisions."""

    name = "promoe"
    proactive = True

    def __init__(self, n_slots: Sequence[int], features: Features = Features(),
                 cost: CostModel | None = None,
                 layer_costs: Sequence[CostModel | None] | None = None) -> None:
        super().__init__(n_slots)
        self.features = features
        # no cost model: every expert uses a slot. Each model the split plans with is this
        # policy's own (the prompt rule of its features), one per distinct one given
        own: dict[int, CostModel] = {}

        def adopt(c: CostModel | None) -> CostModel | None:
            if c is None or not features.split:
                return None
            if id(c) not in own:
                own[id(c)] = c if c.prompt_split == features.prompt_split else \
                    replace(c, prompt_split=features.prompt_split)
            return own[id(c)]

        self.cost = adopt(cost)
        # per layer, the model of the device holding its slots where that is not ``cost``'s
        self.layer_costs: list[CostModel | None] = [
            c if c is not self.cost else None for c in map(adopt, layer_costs or [])]
        self.lock = threading.Lock()
        self.prefetch_loads = 0
        self.prefetch_refreshed = 0
        self.stale_predictions = 0

    @classmethod
    def create(cls, n_slots: Sequence[int], inputs: PolicyInputs) -> Policy:
        """promoe with ``inputs``' features and the cost models its host split plans with."""
        return cls(n_slots, inputs.features or Features(), inputs.cost, inputs.layer_costs)

    def cost_for(self, layer: int) -> CostModel | None:
        """The cost model pricing ``layer``'s split: its device's, else ``cost``."""
        if layer < len(self.layer_costs):
            own = self.layer_costs[layer]
            if own is not None:
                return own
        return self.cost

    def cost_groups(self) -> list[tuple[CostModel, list[int] | None]]:
        """``cost`` over the layers without one of their own (None when no layer has one),
        then each device's model over its layers."""
        if self.cost is None:
            return []
        groups: dict[int, tuple[CostModel, list[int]]] = {}
        for il, c in enumerate(self.layer_costs):
            if c is not None:
                groups.setdefault(id(c), (c, []))[1].append(il)
        if not groups:
            return [(self.cost, None)]
        own = {il for _, layers in groups.values() for il in layers}
        rest = [il for il in range(len(self.n_slots)) if il not in own]
        return [(self.cost, rest), *groups.values()]

    def initial_loads(self) -> list[tuple[int, int, int]]:
        """Every slot filled before the first token, as ncmoe's device layers are at load: with
        no routing seen yet, expert i in slot i of each layer. A long first prompt then copies
        only the experts the slots lack, and a short one starts at the slots' share of hits."""
        return [(il, s, s) for il, n in enumerate(self.n_slots) for s in range(n)]

    # -- the decode gate the engine runs without calling the policy ---------------------------
    def decode_gate(self, n_used: int) -> tuple[list[int], list[float], bool] | None:
        """The tables with which the engine decides a one-token gate of ``n_used`` experts as
        ``gate`` would (forecache_cache_set_decode_gate): for m missing experts while f of the
        resident ones are still copying, index ``m * (n_used + 1) + f``, how many missing
        experts the host computes (-1: call ``gate``) and their modelled host seconds; and
        whether the gate preempts. None when this policy's gate is not that one."""
        if not self._engine_gates():
            return None
        host_k, host_s = self._gate_table(self.cost, n_used)
        return host_k, host_s, self.features.preempt

    def _engine_gates(self) -> bool:
        """The engine's decode gate decides as this policy's ``gate`` would (cache-first
        order, this class's gate and eviction order)."""
        return self.features.reorder and type(self).gate is ProMoEPolicy.gate and \
            type(self).eviction_order is ProMoEPolicy.eviction_order

    def layer_decode_gates(self, n_used: int) -> list[tuple[list[int], list[int], list[float]]]:
        """The layers whose device has a cost model of its own, with that model's decode-gate
        tables (``decode_gate``'s, for ``forecache_cache_set_layer_decode_gate``)."""
        if not self._engine_gates():
            return []
        return [(layers, *self._gate_table(c, n_used))
                for c, layers in self.cost_groups()[1:] if layers]

    @staticmethod
    def _gate_table(cost: CostModel | None, n_used: int) -> tuple[list[int], list[float]]:
        """``decode_gate``'s tables as ``cost`` plans (None: no split, every expert a slot)."""
        size = (n_used + 1) * (n_used + 1)
        host_k, host_s = [-1] * size, [0.0] * size
        for m in range(n_used + 1):
            for fl in range(n_used + 1 - m):
                i = m * (n_used + 1) + fl
                if cost is None:
                    host_k[i] = 0
                    continue
                rows = [(e, 1, e >= m) for e in range(n_used)]
                split, _ = cost.best_split(rows, fl)
                if not split.whole_layer:
                    host_k[i] = len(split.host)
                    host_s[i] = split.host_s / cost.host_scale
        return host_k, host_s

    # -- gate: the layer being computed --------------------------------------------------------
    def gate(self, layer: int, experts: np.ndarray, engine: CopyEngine,
             counts: np.ndarray | None = None, tokens: int = 1) -> bool:
        """Route ``layer`` (distinct experts, first use first; ``counts``: token rows of each;
        ``tokens``: the ubatch's): True to compute from slots (and the host, for the experts
        the split sends there; none for a prompt-sized ubatch unless ``prompt_split``)."""
        f = self.features
        n = self.n_slots[layer]
        with self.lock:
            need = [int(e) for e in experts.tolist()]
            if f.preempt:
                engine.preempt(layer, need)
            expert_of, state = engine.layer_state(layer)
            where = {e: s for s, e in enumerate(expert_of.tolist()) if e >= 0}
            # an expert loaded into a slot after it was staged is computed from its slot (the
            # schedule then gives its stage slot back)
            staged = {e: v for e, v in engine.staged(layer).items() if e not in where} \
                if f.reorder else {}
            oldest = engine.resident_order(layer)
            if f.reorder:
                rank = {SLOT_READY: 0, SLOT_COPYING: 1, SLOT_QUEUED: 2}

                def key(e: int) -> tuple[int, bool]:
                    # staged experts after the resident ones of their state: a group reads
                    # either the slots or the stage slots, so they are not interleaved
                    if e in where:
                        return rank[int(state[where[e]])], False
                    return (rank[staged[e][1]], True) if e in staged else (3, False)

                order = sorted(need, key=key)
            else:
                order = sorted(need)  # the frameworks' expert-id order
            needed = set(need)
            free = [s for s in range(n) if expert_of[s] < 0]
            victims = free + self.eviction_order(layer, needed, expert_of, oldest)
            host: list[int] = []
            cost = self.cost_for(layer)
            if cost is not None and counts is not None and cost.splits(tokens):
                in_host = engine.host_resident(layer)
                rows: list[Row] = [(e, int(r), e in where or e in staged) if in_host is None
                                   else (e, int(r), e in where or e in staged, e in in_host)
                                   for e, r in zip(need, counts.tolist(), strict=True)]
                in_flight = sum(1 for e in need if e in where and state[where[e]] != SLOT_READY)
                split = cost.choose_split(rows, in_flight)
                if split.whole_layer:
                    # all on the CPU: cheaper than any use of the slots now. As many missing
                    # experts as can be copied while the CPU computes the layer still enter the
                    # cache (a cold cache would stay cold); more would hold up the next layers.
                    hidden = int(split.host_s // cost.copy_s())
                    for e in [e for e in need if e not in where][:hidden]:
                        if not victims or engine.load(layer, e, victims[0], LOW) != 0:
                            break
                        victims.pop(0)
                    return False
                host = split.host
                if host:
                    on_host = set(host)
                    order = [e for e in order if e not in on_host]
            on_slots = [e for e in order if e not in staged]
            if len(on_slots) > n and not f.reorder:
                return False  # cannot stream without reordered compute: from host memory
            slots: list[int] = []
            taken: list[int] = []  # layer slots in compute order
            for e in order:
                if e in staged:
                    slots.append(n + staged[e][0])
                    continue
                k = len(taken)
                if k >= n:
                    s = taken[k - n]  # streams through the slot computed longest ago
                elif e in where:
                    s = where[e]
                else:
                    s = victims.pop(0)
                taken.append(s)
                slots.append(s)
            if engine.schedule(layer, order + host, slots + [-1] * len(host), HIGH) != 0:
                return False
            # experts computed on the host still enter the cache, behind this layer's copies, in
            # slots the schedule does not use: the cache keeps following the routing
            for e in host:
                if not victims or engine.load(layer, e, victims[0], LOW) != 0:
                    break
                victims.pop(0)
            if len(on_slots) > n:
                self._stage_next(layer, engine)
            return True

    def _stage_next(self, layer: int, engine: CopyEngine) -> None:
        """A layer that streams (a prompt pass routing more experts than it has slots): the next
        cached layer will likely stream too, so its missing experts are copied into stage slots
        behind this layer's copies, keeping the bus busy while this layer's copies wait for the
        slots they reuse (half the stage slots at most: the other half serves this layer)."""
        nxt = next((il for il in range(layer + 1, len(self.n_slots)) if self.n_slots[il]), -1)
        cap = (engine.stage_slots() + 1) // 2
        if nxt < 0 or cap == 0:
            return
        expert_of, _ = engine.layer_state(nxt)
        resident = {int(e) for e in expert_of.tolist() if e >= 0}
        have = engine.staged(nxt)
        todo = cap - len(have)
        for e in range(engine.n_experts(nxt)):
            if todo <= 0:
                break
            if e in resident or e in have:
                continue
            if engine.stage(nxt, e, LOW) < 0:
                break
            todo -= 1

    # -- prefetch: a layer ahead ---------------------------------------------------------------
    def prefetch(self, layer: int, experts: Sequence[int], pass_id: int,
                 engine: CopyEngine) -> int:
        """Queue predicted ``experts`` of ``layer`` (best first) at low priority; a resident one
        only refreshes its recency. Predictions for a layer already routed in ``pass_id`` (or of an
        older pass) are stale and dropped. Returns the copies queued."""
        if not self.features.prefetch or self.n_slots[layer] == 0:
            return 0
        with self.lock:
            current, routed = engine.passes(layer)
            if pass_id != current or routed == pass_id:
                self.stale_predictions += 1
                return 0
            expert_of, _ = engine.layer_state(layer)
            resident = {int(e) for e in expert_of.tolist() if e >= 0}
            picked = [int(e) for e in experts][:self.n_slots[layer]]
            again = [e for e in reversed(picked) if e in resident]  # best ends most recent
            if again:
                engine.touch(layer, again)
                self.prefetch_refreshed += len(again)
            return self._load_picked(layer, picked, resident, expert_of, engine)

    def warm(self, layer: int, experts: Sequence[int], engine: CopyEngine) -> int:
        """Queue ``experts`` of ``layer`` (best first) at low priority now, whatever pass the
        engine is in: a token about to be recomputed routes them (MoBiLE's big pass after its
        little pass). Returns the copies queued."""
        if not self.features.prefetch or self.n_slots[layer] == 0:
            return 0
        with self.lock:
            expert_of, _ = engine.layer_state(layer)
            resident = {int(e) for e in expert_of.tolist() if e >= 0}
            picked = list(dict.fromkeys(int(e) for e in experts))[:self.n_slots[layer]]
            return self._load_picked(layer, picked, resident, expert_of, engine)

    def _load_picked(self, layer: int, picked: list[int], resident: set[int],
                     expert_of: np.ndarray, engine: CopyEngine) -> int:
        """Queue the ``picked`` experts not ``resident`` at LOW into the prefetch victims, in
        order (the lock held); the copies queued."""
        victims = self.prefetch_victims(layer, picked, expert_of, engine.resident_order(layer))
        queued = 0
        for e in picked:
            if e in resident or not victims:
                continue
            if engine.load(layer, e, victims.pop(0), LOW) != 0:
                break  # the layer is being computed: too late for the rest
            queued += 1
        self.prefetch_loads += queued
        return queued

    def prefetch_victims(self, layer: int, picked: list[int], expert_of: np.ndarray,
                         oldest: list[int]) -> list[int]:
        """Slots a prefetch of ``picked`` (best first) may fill, in order: free slots, then the
        eviction order of the others (``expert_of`` and ``oldest``: the engine's slot table and
        resident slots, least recently used first; called with the lock held)."""
        free = [s for s in range(self.n_slots[layer]) if expert_of[s] < 0]
        return free + self.eviction_order(layer, set(picked), expert_of, oldest)

    def eviction_order(self, layer: int, keep: set[int], expert_of: np.ndarray,
                       oldest: list[int]) -> list[int]:
        """Slots of ``layer``'s resident experts outside ``keep``, the first to give up first:
        the engine's eviction order (least recently used first while every key is 0; called
        with the lock held)."""
        return [s for s in oldest if int(expert_of[s]) not in keep]
