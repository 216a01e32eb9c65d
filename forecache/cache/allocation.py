"""Slots per MoE layer from measured reuse: the expert budget goes where a slot saves most misses.

The even split (``BudgetSplit.slots_per_layer``) gives every layer the same number of slots, but
layers differ in how much their routing repeats: a layer whose requests keep to a few experts
gains little from a tenth slot, one that spreads gains a lot. ``trace.stats.lru_hit_curves``
measures, from a routing trace, the hits a per-layer LRU cache of every size would get;
``allocate_slots`` then
hands out a fixed total greedily by marginal gain (weighted by each layer's miss cost), at least
one slot per layer. The runtime (``placement``) and the simulator (``sim.run``) both call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def layer_decay(n_layers: int) -> np.ndarray:
    """MoE-Infinity's layer term ``1 - i / L`` (Algorithm 1): earlier layers' experts are worth
    more in the cache, because later layers are the ones prefetching can cover."""
    return 1.0 - np.arange(n_layers, dtype=np.float64) / max(n_layers, 1)


def allocate_slots(curves: np.ndarray, total: int, *, weights: Sequence[float] | None = None,
                   minimum: int = 1) -> list[int]:
    """Split ``total`` slots over the layers of ``curves`` (hits [L, S + 1] for 0..S slots, e.g.
    ``lru_hit_curves``): each layer gets ``minimum``, then each step gives the layer whose next
    slots save the most weighted misses per slot (looking ahead over flat stretches, since a layer
    saves nothing until its slots hold a whole row's experts). Ties go to the layer with fewer
    slots, then the lower index; when no layer gains any more, the rest is spread evenly. At most
    S per layer; ``total`` is capped at L * S and must cover the minimums."""
    curves = np.asarray(curves, dtype=np.float64)
    n_layers, cap = curves.shape[0], curves.shape[1] - 1
    if n_layers == 0:
        return []
    total = min(int(total), n_layers * cap)
    if total < n_layers * minimum:
        raise ValueError(f"{total} slots cannot give {n_layers} layers {minimum} each")
    w = np.ones(n_layers) if weights is None else np.asarray(weights, dtype=np.float64)
    alloc = np.full(n_layers, minimum, dtype=np.int64)
    left = total - int(alloc.sum())
    while left > 0:
        best = (0.0, 0, 0)  # (gain per slot, -slots, -layer) of the best step
        step = None
        for il in range(n_layers):
            a = int(alloc[il])
            room = min(left, cap - a)
            if room <= 0:
                continue
            steps = np.arange(1, room + 1)
            gains = w[il] * (curves[il, a + steps] - curves[il, a]) / steps
            j = int(np.argmax(gains))  # first maximum: the shortest step with the best rate
            key = (float(gains[j]), -a, -il)
            if gains[j] > 0 and (step is None or key > best):
                best, step = key, (il, j + 1)
        if step is None:
            break
        alloc[step[0]] += step[1]
        left -= step[1]
    while left > 0:  # nothing gains: even spread over the layers with room
        open_ = np.flatnonzero(alloc < cap)
        il = int(open_[np.argmin(alloc[open_])])
        alloc[il] += 1
        left -= 1
    return alloc.tolist()


def reallocate(even: Sequence[int], moe_layers: Sequence[int], curves: np.ndarray,
               weights: Sequence[float] | None = None) -> list[int]:
    """``even`` (slots per model layer, the even split) with the same total moved between
    ``moe_layers`` by ``allocate_slots`` over ``curves`` (one row per MoE layer, in order). A
    split that cannot give every MoE layer one slot, or curves of another depth, stay as given."""
    layers = list(moe_layers)
    total = sum(even[il] for il in layers)
    if len(curves) != len(layers) or total < len(layers):
        return list(even)
    out = list(even)
    for il, n in zip(layers, allocate_slots(curves, total, weights=weights), strict=True):
        out[il] = n
    return out
