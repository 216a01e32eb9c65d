"""MoE-Infinity's activation-aware expert cache (Xue et al., section 4.6 and Algorithm 1) as a
forecache policy, ``infinity``.

MoE-Infinity keeps one cache for all layers and evicts the expert of lowest priority, the
priority being the expert's share in the predicted EAM (the current request's activation matrix
matched against the EAM collection) times the layer term ``1 - layer / L``. forecache's slots
are pools per layer, so the two parts act at different times:

* across layers, the measured reuse sizes the pools before the model loads
  (``cache.allocation``: more slots where a slot saves more misses). The layer term, applied as
  each layer's miss cost there, cost hits on every shared trace (late layers starve: OLMoE 70%
  against 77% hits) and is left out; ``layer_decay`` keeps it for comparison
  (benchmarks/sim_infinity.py);
* within a layer, a miss or a prefetch replaces the resident expert of lowest priority that the
  layer does not need now. The current request's own EAM row comes first (how often this request
  has routed the expert: the request matched with itself), then the rank the EAM collection's
  matches give the expert (MoE-Infinity's prediction), then how often any request has routed it,
  then recency. Request frequency first measured better than the matches' rank first on every
  shared trace (OLMoE: 85% against 77% hits at 0.55 of the experts), since a request keeps
  reusing its own experts more reliably than other requests predict them.

The priority lives in the copy engine as each expert's eviction key (``forecache_cache_set_keys``):
the engine adds to the key of every routed expert at every gate, its own or the one C decides for
a decode token, and orders eviction by key, then recency; the policy moves a key's prediction
part when a forecast arrives and clears the request's part when a request begins. So the decode
gate in C evicts as this policy would, and ``infinity`` decodes without Python between layers as
``promoe`` does.

Prefetching follows the predictions as MoE-Infinity does: the best ``prefetch_n`` predicted experts
of a coming layer are copied at low priority into free slots or over lower-priority ones. The copy
mechanics (early preemption, cache-first order, streaming, chunks, the host split) are
``ProMoEPolicy``'s, so ``infinity`` and ``promoe`` differ only in what they keep and predict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from forecache.cache.allocation import reallocate
from forecache.cache.cost import CostModel
from forecache.cache.policies import CopyEngine, Policy, PolicyInputs
from forecache.cache.prefetcher import Features, ProMoEPolicy

if TYPE_CHECKING:
    from forecache.gguf.header import ModelFile

# An eviction key packs the priority tuple (request rows, predicted rank, all rows) into one int64,
# compared as the tuple is: the request's rows from bit 44, the rank from bit 32, all rows below.
REQUEST_SHIFT, RANK_SHIFT = 44, 32
RANK_MAX = (1 << (REQUEST_SHIFT - RANK_SHIFT)) - 1
USES_MASK = (1 << RANK_SHIFT) - 1
# what a routed token row adds: one to the request's rows and one to all rows
ROUTE_STEP = (1 << REQUEST_SHIFT) + 1


class InfinityPolicy(ProMoEPolicy):
    """Activation-aware eviction and prefetch over ``ProMoEPolicy``'s copy mechanics.

    The forecasts it is given (``prefetch``) are whole rankings, best first, of the experts a
    layer's EAM prediction activates (``Forecaster(..., n_predict=n_expert, min_score=0)``);
    the first ``prefetch_n`` are copied ahead, the whole ranking sets eviction priority."""

    name = "infinity"
    ranks_experts = True
    routes_every_layer = True  # a request's activation matrix has a row for every layer

    def __init__(self, n_slots: Sequence[int], features: Features | None = None,
                 cost: CostModel | None = None,
                 layer_costs: Sequence[CostModel | None] | None = None, *,
                 prefetch_n: int = 1) -> None:
        super().__init__(n_slots, features or Features(), cost, layer_costs)
        if prefetch_n < 1:
            raise ValueError(f"prefetch_n must be >= 1 (got {prefetch_n})")
        self.prefetch_n = prefetch_n
        # per layer: expert -> rank from the latest prediction (higher: keep longer); the
        # engine's keys hold it too
        self.predicted: list[dict[int, int]] = [{} for _ in self.n_slots]
        self.engine: CopyEngine | None = None

    @classmethod
    def create(cls, n_slots: Sequence[int], inputs: PolicyInputs) -> Policy:
        """infinity prefetching a token's worth (``inputs.top_k``) of each ranking."""
        return cls(n_slots, inputs.features, inputs.cost, inputs.layer_costs,
                   prefetch_n=inputs.top_k)

    @classmethod
    def layer_slots(cls, model: ModelFile, even: list[int],
                    groups: Sequence[Sequence[int]] | None = None) -> list[int]:
        """``even`` moved between the MoE layers by the decode reuse measured in the model's
        stored EAM collection (``cache.allocation``), within each of ``groups`` (the layers of
        one device: each keeps its total) where given; without a collection, ``even``."""
        from forecache.predictor.store import has_eam, load_eam

        if not has_eam(model):
            return even
        moe = model.moe_layers()
        curves = load_eam(model).hit_curves
        if groups is None:
            return reallocate(even, moe, curves)
        row = {il: i for i, il in enumerate(moe)}
        if len(curves) != len(moe):
            return even  # a collection of another depth
        out = list(even)
        for group in groups:
            layers = [il for il in group if il in row]
            part = reallocate(even, layers, curves[[row[il] for il in layers]])
            for il in layers:
                out[il] = part[il]
        return out

    def attach(self, engine: CopyEngine) -> None:
        """Keys of 0 in every cached layer, growing with every routed row."""
        self.engine = engine
        for layer, n in enumerate(self.n_slots):
            if n:
                engine.set_keys(layer, [0] * len(engine.layer_keys(layer)), ROUTE_STEP)

    def begin_request(self) -> None:
        """Forget the finished request's predictions and rows (all-time rows stay)."""
        eng = self.engine
        with self.lock:
            for layer, n in enumerate(self.n_slots):
                old = self.predicted[layer]
                self.predicted[layer] = {}
                if eng is None or not n:
                    continue
                keys = eng.layer_keys(layer)
                deltas = [-((int(k) >> REQUEST_SHIFT) << REQUEST_SHIFT)
                          - (old.get(e, 0) << RANK_SHIFT) for e, k in enumerate(keys.tolist())]
                eng.add_keys(layer, list(range(len(deltas))), deltas)

    def prefetch(self, layer: int, experts: Sequence[int], pass_id: int,
                 engine: CopyEngine) -> int:
        """Take ``experts`` (best first) as ``layer``'s priorities, then copy the first
        ``prefetch_n`` ahead; an empty ranking (no EAM match) leaves the frequency order."""
        ranked = [int(e) for e in experts]
        with self.lock:
            old = self.predicted[layer]
            new = {e: min(len(ranked) - i, RANK_MAX) for i, e in enumerate(ranked)}
            self.predicted[layer] = new
            changed = [e for e in set(old) | set(new) if old.get(e, 0) != new.get(e, 0)]
            if changed and self.n_slots[layer]:
                engine.add_keys(layer, changed, [(new.get(e, 0) - old.get(e, 0)) << RANK_SHIFT
                                                 for e in changed])
        return super().prefetch(layer, ranked[:self.prefetch_n], pass_id, engine)

    def priority(self, layer: int, expert: int, keys: np.ndarray | None = None
                 ) -> tuple[int, int, int]:
        """How much ``expert`` of ``layer`` is worth keeping, compared as a tuple: the current
        request's routed rows (its own EAM row, the closest match there is), then the rank the
        matched EAMs give it, then the rows of every request so far (from the engine's keys, or
        ``keys``)."""
        if keys is None:
            assert self.engine is not None, "the policy is not attached to an engine"
            keys = self.engine.layer_keys(layer)
        k = int(keys[expert])
        return k >> REQUEST_SHIFT, (k >> RANK_SHIFT) & RANK_MAX, k & USES_MASK

    def prefetch_victims(self, layer: int, picked: list[int], expert_of: np.ndarray,
                         oldest: list[int]) -> list[int]:
        """Free slots, then slots whose expert is worth less than the predicted expert that
        would replace it (MoE-Infinity never evicts for a lower-priority prefetch)."""
        assert self.engine is not None
        keys = self.engine.layer_keys(layer)
        resident = {int(e) for e in expert_of.tolist() if e >= 0}
        incoming = [e for e in picked if e not in resident]
        out = []
        for e, s in zip(incoming, super().prefetch_victims(layer, picked, expert_of, oldest),
                        strict=False):
            old = int(expert_of[s])
            if old >= 0 and keys[old] >= keys[e]:
                break
            out.append(s)
        return out
