"""Slot assignment policies: which expert goes into which slot when the gate hook fires.

A policy mirrors the slot contents it has asked for, so it never queries the C side on the hot path.
``on_gate`` returns the (expert, slot) copies to queue, or None to compute the layer from host
memory (more distinct experts than the policy may place, e.g. during prefill).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from forecache.native.cache_api import HIGH

if TYPE_CHECKING:
    from forecache.cache.cost import CostModel
    from forecache.cache.prefetcher import Features
    from forecache.gguf.header import ModelFile

# Slots the static policy keeps for misses (ProMoE's static baseline).
STATIC_SPARE_SLOTS = 2


class CopyEngine(Protocol):
    """What a policy drives: slot loads, preemption, the compute schedule, slot states and
    recency (the engine stamps a slot when its layer routes to it, a load or schedule fills it,
    or ``touch`` names it), and forward passes."""

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

    def resident_order(self, layer: int) -> list[int]:
        """Slots holding an expert in eviction order: lowest key first, least recently used
        first among equal keys."""
        ...

    def set_keys(self, layer: int, keys: Sequence[int], step: int) -> None:
        """Eviction keys of every expert of ``layer``, and what a token row routed to an
        expert adds to its key."""
        ...

    def add_keys(self, layer: int, experts: Sequence[int], deltas: Sequence[int]) -> None:
        """Add ``deltas`` to the eviction keys of ``experts``."""
        ...

    def layer_keys(self, layer: int) -> np.ndarray:
        """The eviction key of every expert of ``layer``."""
        ...

    def touch(self, layer: int, experts: Sequence[int]) -> None:
        """Mark the slots of ``experts`` used, in order (the last most recent)."""
        ...

    def passes(self, layer: int) -> tuple[int, int]:
        """(current forward pass, the pass ``layer`` was last routed in)."""
        ...

    def stage_slots(self) -> int:
        """Stage slots: device memory for experts outside every layer's slots (0: none)."""
        ...

    def n_experts(self, layer: int) -> int:
        """Routed experts of ``layer``."""
        ...

    def stage(self, layer: int, expert: int, priority: int) -> int:
        """Copy ``expert`` of ``layer`` into a free stage slot: the stage slot, or -1."""
        ...

    def staged(self, layer: int) -> dict[int, tuple[int, int]]:
        """Experts of ``layer`` in stage slots: expert -> (stage slot, SLOT_* state). A schedule
        computes one from slot ``n_slots + stage slot``."""
        ...

    def host_resident(self, layer: int) -> set[int] | None:
        """With a disk tier, the experts of ``layer`` whose read into host memory is done (the
        others are read from the model file before either side computes them); None without
        one: every expert is in host memory."""
        ...


def hit_rate(hits: int, misses: int) -> float | None:
    """Share of routed experts found in a slot; None when nothing was routed."""
    looked_up = hits + misses
    return hits / looked_up if looked_up else None


# up to this many routed ids (decode's few), a dict finds the distinct ones faster than numpy
SMALL_ROUTE = 64


def first_use(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct experts of ``ids`` in order of first use, and how many rows route to each."""
    if ids.size <= SMALL_ROUTE:
        seen: dict[int, int] = {}
        for e in ids.tolist():
            seen[e] = seen.get(e, 0) + 1
        return (np.fromiter(seen.keys(), ids.dtype, len(seen)),
                np.fromiter(seen.values(), np.int64, len(seen)))
    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    by_use = np.argsort(first, kind="stable")
    return uniq[by_use], counts[by_use]


@dataclass(frozen=True)
class PolicyInputs:
    """What building a policy may draw on (``Policy.create``); each policy takes what it needs."""

    features: Features | None = None  # promoe's (and infinity's) techniques; None: all on
    cost: CostModel | None = None  # plans host/device splits (with ``features.split``)
    # per model layer, the cost model of the device its slots are on, where devices differ
    # (None, or a None entry: ``cost``)
    layer_costs: Sequence[CostModel | None] | None = None
    profile: np.ndarray | None = None  # static: routed counts [n_layer, n_expert]
    top_k: int = 1  # experts a token routes (infinity prefetches that many of a ranking)


class Policy:
    """What the expert cache asks of a policy: per-layer slot counts, copies before the first
    token, the decision at each layer's gate, and forecasts to act on. Reactive policies implement
    ``on_gate`` only; a proactive one (``ProMoEPolicy``) overrides ``gate`` and ``prefetch``.

    The class says what the policy needs (``cache.registry`` names the classes): a forecaster
    and stage slots (``proactive``), whole forecast rankings (``ranks_experts``), a routing
    profile (``needs_profile``) and its own split of the slots between layers (``layer_slots``).
    """

    name = "base"
    #: forecasts the coming layers' experts, copies them ahead and computes cache-first (with
    #: stage slots for prompt passes)
    proactive = False
    #: the forecasts it acts on are whole rankings of every expert (EAM's), not a top few
    ranks_experts = False
    #: pins experts from a routing profile (``PolicyInputs.profile``)
    needs_profile = False
    #: plans host/device splits by cost; the cache corrects it with measured rates (None: no split)
    cost: CostModel | None = None
    #: forward passes (ubatches) routed so far: a forecast made in an older pass is stale
    pass_id: int = 0
    #: sees every layer's routing, even a layer whose every expert is resident (which the
    #: cache otherwise computes without stopping: ``ExpertCache`` quiet layers)
    routes_every_layer = False

    def __init__(self, n_slots: Sequence[int]) -> None:
        self.n_slots = list(n_slots)

    def cost_groups(self) -> list[tuple[CostModel, list[int] | None]]:
        """Each cost model the split plans with and the layers it prices (None: every layer
        no other model prices); empty without a split."""
        return [] if self.cost is None else [(self.cost, None)]

    def cost_for(self, layer: int) -> CostModel | None:
        """The cost model pricing ``layer``'s split (None: no split)."""
        return self.cost

    @classmethod
    def create(cls, n_slots: Sequence[int], inputs: PolicyInputs) -> Policy:
        """This policy over ``n_slots`` from what ``inputs`` gives."""
        return cls(n_slots)

    @classmethod
    def layer_slots(cls, model: ModelFile, even: list[int],
                    groups: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Slots per model layer for ``model`` from the even split ``even`` (most policies keep
        it); ``groups``: layers whose slots share one device's budget, between which alone
        slots may move (None: every layer shares one)."""
        return even

    def attach(self, engine: CopyEngine) -> None:
        """The copy engine this policy drives (the C cache, or the simulator's); a policy that
        keeps state in the engine sets it up here."""

    def initial_loads(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) copies to queue before the first token."""
        return []

    def begin_request(self) -> None:
        """A new request starts (policies with per-request state reset it)."""

    def on_gate(self, layer: int, experts: np.ndarray) -> list[tuple[int, int]] | None:
        raise NotImplementedError

    def decode_gate(self, n_used: int) -> tuple[list[int], list[float], bool] | None:
        """Tables with which the engine decides one-token gates without calling ``gate``
        (``ProMoEPolicy.decode_gate``); None: every gate calls it."""
        return None

    def layer_decode_gates(self, n_used: int) -> list[tuple[list[int], list[int], list[float]]]:
        """Layers that decide by tables of their own, with those tables (none by default)."""
        return []

    def gate(self, layer: int, experts: np.ndarray, engine: CopyEngine,
             counts: np.ndarray | None = None, tokens: int = 1) -> bool:
        """Route ``layer`` (distinct experts; ``counts``: token rows of each; ``tokens``: the
        ubatch's): queue the misses ``on_gate`` asks for; True to compute from slots."""
        loads = self.on_gate(layer, experts)
        if loads is None:
            return False
        for e, s in loads:
            engine.load(layer, e, s, HIGH)
        return True

    def prefetch(self, layer: int, experts: Sequence[int], pass_id: int,
                 engine: CopyEngine) -> int:
        """Act on a forecast that ``experts`` will be routed at ``layer`` (made in pass
        ``pass_id``); returns the copies queued. Reactive policies ignore forecasts."""
        return 0


class HostOnlyPolicy(Policy):
    """Computes every layer from host memory; with a recording cache it profiles routing."""

    name = "host"

    def on_gate(self, layer: int, experts: np.ndarray) -> list[tuple[int, int]] | None:
        return None


class LRUPolicy(Policy):
    """Least recently used per layer; a miss evicts the oldest expert the layer does not need."""

    name = "lru"

    def __init__(self, n_slots: Sequence[int]) -> None:
        super().__init__(n_slots)
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in self.n_slots]

    def on_gate(self, layer: int, experts: np.ndarray) -> list[tuple[int, int]] | None:
        lru = self._lru[layer]
        for e in experts.tolist():
            if e in lru:
                lru.move_to_end(e)
        if len(experts) > self.n_slots[layer]:
            return None
        loads = []
        for e in experts.tolist():
            if e in lru:
                continue
            if len(lru) < self.n_slots[layer]:
                slot = len(lru)
            else:
                _, slot = lru.popitem(last=False)  # oldest; hits were moved to the end above
            lru[e] = slot
            loads.append((e, slot))
        return loads


class LFUPolicy(Policy):
    """Least frequently used per layer: a miss evicts the resident expert the layer has routed
    least often so far (resident or not), the least recently used among equals."""

    name = "lfu"

    def __init__(self, n_slots: Sequence[int]) -> None:
        super().__init__(n_slots)
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in self.n_slots]
        self.uses: list[Counter[int]] = [Counter() for _ in self.n_slots]

    def on_gate(self, layer: int, experts: np.ndarray) -> list[tuple[int, int]] | None:
        lru, uses = self._lru[layer], self.uses[layer]
        need = experts.tolist()
        for e in need:
            uses[e] += 1
            if e in lru:
                lru.move_to_end(e)
        if len(need) > self.n_slots[layer]:
            return None
        needed = set(need)
        # eviction order: fewest uses first, oldest first among equals (the order is stable)
        victims = sorted((e for e in lru if e not in needed), key=lambda e: uses[e])
        loads = []
        for e in need:
            if e in lru:
                continue
            if len(lru) < self.n_slots[layer]:
                slot = len(lru)
            else:
                slot = lru.pop(victims.pop(0))
            lru[e] = slot
            loads.append((e, slot))
        return loads


class StaticPolicy(Policy):
    """The hottest experts of a routing profile stay pinned; two spare slots take misses (LRU).
    A layer with a slot for every expert pins them all."""

    name = "static"
    needs_profile = True

    def __init__(self, n_slots: Sequence[int], profile: np.ndarray) -> None:
        super().__init__(n_slots)
        self.pinned: list[dict[int, int]] = []
        self._spare: list[OrderedDict[int, int]] = []
        self._spare_slots: list[list[int]] = []
        for il, n in enumerate(self.n_slots):
            counts = profile[il] if il < len(profile) else np.zeros(0)
            n_pin = n if 0 < len(counts) <= n else max(n - STATIC_SPARE_SLOTS, 0)
            # stable sort: ties go to the lower expert id, so a profile gives one placement
            hot = np.argsort(-counts, kind="stable")[:n_pin].tolist() if n_pin else []
            self.pinned.append({int(e): s for s, e in enumerate(hot)})
            self._spare.append(OrderedDict())
            self._spare_slots.append(list(range(len(hot), n)))

    @classmethod
    def create(cls, n_slots: Sequence[int], inputs: PolicyInputs) -> Policy:
        """Pins the hottest experts of ``inputs.profile``, which it needs."""
        if inputs.profile is None:
            raise ValueError("policy static needs a routing profile")
        return cls(n_slots, inputs.profile)

    def initial_loads(self) -> list[tuple[int, int, int]]:
        return [(il, e, s) for il, pins in enumerate(self.pinned) for e, s in pins.items()]

    def on_gate(self, layer: int, experts: np.ndarray) -> list[tuple[int, int]] | None:
        pins, spare, free = self.pinned[layer], self._spare[layer], self._spare_slots[layer]
        missing = [e for e in experts.tolist() if e not in pins]
        for e in missing:
            if e in spare:
                spare.move_to_end(e)
        if len(missing) > len(free):
            return None
        loads = []
        for e in missing:
            if e in spare:
                continue
            if len(spare) < len(free):
                slot = free[len(spare)]
            else:
                _, slot = spare.popitem(last=False)
            spare[e] = slot
            loads.append((e, slot))
        return loads
