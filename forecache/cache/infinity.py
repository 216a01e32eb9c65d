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

Prefetching follows the predictions as MoE-Infinity does: the best ``prefetch_n`` predicted experts
of a coming layer are copied at low priority into free slots or over lower-priority ones. The copy
mechanics (early preemption, cache-first order, streaming, chunks, the host split) are
``Prefetcher``'s, so ``infinity`` and ``promoe`` differ only in what they keep and predict.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from forecache.cache.cost import CostModel
from forecache.cache.prefetcher import CopyEngine, Features, Prefetcher


class InfinityPolicy(Prefetcher):
    """Activation-aware eviction and prefetch over ``Prefetcher``'s copy mechanics.

    The forecasts it is given (``prefetch``) are whole rankings, best first, of the experts a
    layer's EAM prediction activates (``Forecaster(..., n_predict=n_expert, min_score=0)``);
    the first ``prefetch_n`` are copied ahead, the whole ranking sets eviction priority."""

    name = "infinity"

    def __init__(self, n_slots: Sequence[int], features: Features | None = None,
                 cost: CostModel | None = None, *, prefetch_n: int = 1) -> None:
        super().__init__(n_slots, features or Features(), cost)
        if prefetch_n < 1:
            raise ValueError(f"prefetch_n must be >= 1 (got {prefetch_n})")
        self.prefetch_n = prefetch_n
        # per layer: expert -> priority from the latest prediction (higher: keep longer)
        self.predicted: list[dict[int, int]] = [{} for _ in self.n_slots]
        self.request_uses: list[Counter[int]] = [Counter() for _ in self.n_slots]
        self.uses: list[Counter[int]] = [Counter() for _ in self.n_slots]

    def begin_request(self) -> None:
        """Forget the finished request's predictions and counts (all-time counts stay)."""
        with self.lock:
            for layer in range(len(self.n_slots)):
                self.predicted[layer] = {}
                self.request_uses[layer] = Counter()

    def gate(self, layer: int, experts: np.ndarray, engine: CopyEngine,
             counts: np.ndarray | None = None) -> bool:
        """Count the routed experts' token rows, then route as ``Prefetcher`` does."""
        rows = counts.tolist() if counts is not None else [1] * len(experts)
        with self.lock:
            req, all_ = self.request_uses[layer], self.uses[layer]
            for e, r in zip(experts.tolist(), rows, strict=True):
                req[e] += r
                all_[e] += r
        return super().gate(layer, experts, engine, counts)

    def prefetch(self, layer: int, experts: Sequence[int], pass_id: int,
                 engine: CopyEngine) -> int:
        """Take ``experts`` (best first) as ``layer``'s priorities, then copy the first
        ``prefetch_n`` ahead; an empty ranking (no EAM match) leaves the frequency order."""
        ranked = [int(e) for e in experts]
        with self.lock:
            self.predicted[layer] = {e: len(ranked) - i for i, e in enumerate(ranked)}
        return super().prefetch(layer, ranked[:self.prefetch_n], pass_id, engine)

    def priority(self, layer: int, expert: int) -> tuple[int, int, int]:
        """How much ``expert`` of ``layer`` is worth keeping, compared as a tuple: the current
        request's routed rows (its own EAM row, the closest match there is), then the rank the
        matched EAMs give it, then the rows of every request so far."""
        return (self.request_uses[layer][expert], self.predicted[layer].get(expert, 0),
                self.uses[layer][expert])

    def eviction_order(self, layer: int, keep: set[int], expert_of: np.ndarray,
                       oldest: list[int]) -> list[int]:
        """Slots of the resident experts outside ``keep``, lowest ``priority`` first, least
        recently used first among equals."""
        resident = [(int(expert_of[s]), s) for s in oldest if int(expert_of[s]) not in keep]
        # sorted is stable: among equal keys the LRU order (oldest first) stays
        resident.sort(key=lambda es: self.priority(layer, es[0]))
        return [s for _, s in resident]

    def prefetch_victims(self, layer: int, picked: list[int], expert_of: np.ndarray,
                         oldest: list[int]) -> list[int]:
        """Free slots, then slots whose expert is worth less than the predicted expert that
        would replace it (MoE-Infinity never evicts for a lower-priority prefetch)."""
        resident = {int(e) for e in expert_of.tolist() if e >= 0}
        incoming = [e for e in picked if e not in resident]
        out = []
        for e, s in zip(incoming, super().prefetch_victims(layer, picked, expert_of, oldest),
                        strict=False):
            old = int(expert_of[s])
            if old >= 0 and self.priority(layer, old) >= self.priority(layer, e):
                break
            out.append(s)
        return out
