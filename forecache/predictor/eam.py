"""MoE-Infinity's request-level activation tracing (Xue et al., sections 4.3-4.5, appendix B.1).

An Expert Activation Matrix (EAM) is an [L, E] matrix of token counts per expert. The Expert
Activation Matrix Collection (EAMC) keeps up to ``capacity`` finished requests' EAMs. While a
request runs, its EAM so far (all layers of tokens < t, layers <= ``layer_from`` of token t) is the
query: the ``matches`` stored EAMs with the highest cosine similarity to it (positive only) are
row-normalised and summed, and the ``layer_to`` row of that sum, scaled by the layer proximity
``1 - (layer_to - layer_from) / L``, is the prediction (plus the layer's popularity prior scaled
by ``prior_weight``; an empty query or collection gives the prior alone). When the collection is
full, a new EAM replaces the stored one most similar to it (recency plus diversity, B.1).

Cost: the query keeps its dot product with every stored EAM and its squared norm up to date, so an
``observe`` costs O(capacity * k); a match (once per observed layer, shared by all its targets) is
an O(capacity) selection. All counts and dot products are integers held exactly in floating point,
so the vectorised ``score_request`` reproduces the online scores bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from forecache.predictor.base import Predictor
from forecache.trace.format import Request

# Vectorised scoring works on blocks of tokens: bounds the [tokens, layers, capacity] buffers.
_BLOCK_CELLS = 1 << 21


def request_eam(experts: np.ndarray, n_expert: int) -> np.ndarray:
    """The EAM [L, E] (float64 counts) of a request's routed experts [T, L, k]; -1 ids ignored."""
    ex = np.asarray(experts, dtype=np.int64)
    n_layers = ex.shape[1]
    layer = np.broadcast_to(np.arange(n_layers)[None, :, None], ex.shape)
    known = ex >= 0
    cells = layer[known] * n_expert + ex[known]
    return np.bincount(cells, minlength=n_layers * n_expert).astype(np.float64).reshape(
        n_layers, n_expert)


def top_matches(sim: np.ndarray, m: int) -> np.ndarray:
    """Per row of ``sim`` [R, n]: the columns of the ``m`` highest positive values, highest
    first, ties lower column first (a stable argsort of ``-sim`` cut at ``m``, positives only);
    [R, m] int64, padded with -1."""
    n_rows, n = sim.shape
    out = np.full((n_rows, m), -1, dtype=np.int64)
    if n_rows == 0 or n == 0 or m <= 0:
        return out
    cand = sim > 0
    if n > m:
        # O(n) cut: only values >= the m-th largest can be among the first m.
        kth = -np.partition(-sim, m - 1, axis=1)[:, m - 1]
        cand &= sim >= kth[:, None]
    r, c = np.nonzero(cand)
    order = np.lexsort((c, -sim[r, c], r))
    r, c = r[order], c[order]
    rank = np.arange(r.size) - np.searchsorted(r, r)
    keep = rank < m
    out[r[keep], rank[keep]] = c[keep]
    return out


class EAMPredictor(Predictor):
    """MoE-Infinity's EAMC matching, with optional online learning of finished requests."""

    name = "eam"
    needs = ()

    def __init__(self, n_layers: int, n_expert: int, top_k: int, *, capacity: int = 1000,
                 matches: int = 3, learn_online: bool = True, prior_weight: float = 1e-3,
                 ) -> None:
        """``capacity``: EAMs kept; ``matches``: EAMs aggregated per prediction;
        ``learn_online``: each finished request's EAM joins the collection."""
        super().__init__(n_layers, n_expert, top_k)
        if capacity < 1 or matches < 1:
            raise ValueError(f"capacity and matches must be >= 1 (got {capacity}, {matches})")
        self.capacity = int(capacity)
        self.matches = int(matches)
        self.learn_online = bool(learn_online)
        self.prior_weight = float(prior_weight)
        # Counts expert-major ([L, E, slot]) so a query update reads contiguous slot vectors;
        # float32 holds counts exactly up to 2**24 tokens per cell.
        self._counts = np.zeros((n_layers, n_expert, self.capacity), dtype=np.float32)
        self._rows = np.zeros((n_layers, self.capacity, n_expert), dtype=np.float32)
        self._norms = np.zeros(self.capacity, dtype=np.float64)
        self._n = 0
        self.begin_request()

    # -- the collection -------------------------------------------------------------------------
    @property
    def collection_size(self) -> int:
        """Number of EAMs stored (at most ``capacity``)."""
        return self._n

    @property
    def collection(self) -> np.ndarray:
        """A copy of the stored EAMs, [collection_size, L, E] float64 counts, by slot."""
        return self._counts[:, :, :self._n].transpose(2, 0, 1).astype(np.float64)

    def clear(self) -> None:
        """Empty the collection."""
        self._counts[:] = 0.0
        self._rows[:] = 0.0
        self._norms[:] = 0.0
        self._n = 0
        self._dots[:] = 0.0
        self._match = None

    def add(self, eam: np.ndarray) -> int:
        """Store an EAM [L, E] of counts; when full, it replaces the stored EAM with the highest
        cosine similarity to it (lowest slot on ties). Returns the slot, or -1 for an all-zero
        EAM (nothing to match)."""
        eam = np.asarray(eam, dtype=np.float64).reshape(self.n_layers, self.n_expert)
        norm = float(np.sqrt(np.sum(eam * eam)))
        if norm == 0.0:
            return -1
        if self._n < self.capacity:
            slot = self._n
            self._n += 1
        else:
            flat = self._counts.reshape(self.n_layers * self.n_expert, self.capacity)
            sim = (eam.reshape(-1) @ flat) / (self._norms * norm)
            slot = int(np.argmax(sim))
        self._counts[:, :, slot] = eam
        sums = eam.sum(axis=1, keepdims=True)
        self._rows[:, slot] = np.divide(eam, sums, out=np.zeros_like(eam), where=sums > 0)
        self._norms[slot] = norm
        # keep a running query consistent with the new slot
        self._dots[slot] = float(np.sum(self._query * eam))
        self._match = None
        return slot

    def restore(self, eams: np.ndarray, prior: np.ndarray) -> None:
        """Take a stored collection: ``prior`` [L, E] and ``eams`` [N, L, E] (a fitted
        predictor's ``prior`` and ``collection``), added in order to a fresh collection."""
        self.prior = np.asarray(prior, dtype=np.float64).reshape(self.n_layers, self.n_expert)
        self.clear()
        for eam in np.asarray(eams):
            self.add(eam)

    def fit(self, requests: Sequence[Request]) -> None:
        """Learn the prior, then fill a fresh collection with the requests' EAMs in order."""
        super().fit(requests)
        self.clear()
        for req in requests:
            self.add(request_eam(req.experts, self.n_expert))

    # -- online ---------------------------------------------------------------------------------
    def begin_request(self) -> None:
        """Start an empty query."""
        self._query = np.zeros((self.n_layers, self.n_expert), dtype=np.float64)
        self._qq = 0.0
        self._dots = np.zeros(self.capacity, dtype=np.float64)
        self._match: np.ndarray | None = None

    def end_request(self) -> None:
        """Store the finished request's EAM (if ``learn_online``) and clear the query."""
        if self.learn_online:
            self.add(self._query)
        self.begin_request()

    def observe(self, layer: int, experts: np.ndarray) -> None:
        """Count the token's known experts at ``layer`` into the query; O(capacity * k)."""
        ids = np.asarray(experts, dtype=np.int64)
        ids = ids[ids >= 0]
        if ids.size == 0:
            return
        for e in ids.tolist():
            q = self._query[layer, e]
            self._qq += 2.0 * q + 1.0
            self._query[layer, e] = q + 1.0
        n = self._n
        if n:
            self._dots[:n] += self._counts[layer, ids, :n].sum(axis=0, dtype=np.float64)
        self._match = None

    def similarities(self) -> np.ndarray:
        """Cosine similarity [collection_size] of the query to each stored EAM (0 if empty)."""
        n = self._n
        if self._qq == 0.0:
            return np.zeros(n)
        return self._dots[:n] / (self._norms[:n] * np.sqrt(self._qq))

    def predict(self, layer_from: int, layer_to: int, *, hidden: np.ndarray | None = None,
                ) -> np.ndarray:
        """Scores [E] for ``layer_to``: proximity-scaled sum of the matched EAMs' normalised
        rows, plus the scaled prior."""
        term = self.prior_weight * self.prior[layer_to]
        n = self._n
        if n == 0 or self._qq == 0.0:
            return term
        if self._match is None:
            # dots / norms ranks like the cosine (the query norm is common to all slots)
            self._match = top_matches((self._dots[:n] / self._norms[:n])[None], self.matches)[0]
        acc = np.zeros(self.n_expert, dtype=np.float64)
        rows = self._rows[layer_to]
        for slot in self._match.tolist():
            if slot >= 0:
                acc += rows[slot]
        return acc * (1.0 - (layer_to - layer_from) / self.n_layers) + term

    # -- evaluation -----------------------------------------------------------------------------
    def score_request(self, req: Request, pairs: Sequence[tuple[int, int]],
                      ) -> dict[tuple[int, int], np.ndarray]:
        """Vectorised over blocks of tokens: the query's dot products at every (token, layer)
        are a running sum of exact integers, then matching and aggregation follow ``predict``
        operation for operation, so the scores equal the online path's."""
        n_tok, n_l, n_e = req.n_tokens, self.n_layers, self.n_expert
        out = {pair: np.zeros((n_tok, n_e), dtype=np.float32) for pair in pairs}
        froms = sorted({lf for lf, _ in pairs})
        by_from = {lf: [p for p in pairs if p[0] == lf] for lf in froms}
        ex = req.experts.astype(np.int64)
        n = self._n
        # Known routes so far, per (token, layer) state: zero means an empty query (prior only).
        seen = np.cumsum((ex >= 0).sum(axis=2).reshape(-1)).reshape(n_tok, n_l)
        terms = {lt: self.prior_weight * self.prior[lt] for _, lt in pairs}
        block = max(1, _BLOCK_CELLS // max(1, n_l * max(n, 1)))
        carry = np.zeros(n, dtype=np.float64)
        layer_idx = np.broadcast_to(np.arange(n_l)[None, :], (block, n_l))
        for t0 in range(0, n_tok, block):
            t1 = min(t0 + block, n_tok)
            b = t1 - t0
            if n == 0:
                for pair in pairs:
                    out[pair][t0:t1] = terms[pair[1]]
                continue
            contrib = np.zeros((b, n_l, n), dtype=np.float64)
            for j in range(ex.shape[2]):
                e = ex[t0:t1, :, j]
                known = e >= 0
                contrib[known] += self._counts[layer_idx[:b][known], e[known], :n]
            dots = np.cumsum(contrib.reshape(b * n_l, n), axis=0).reshape(b, n_l, n)
            dots += carry
            carry = dots[-1, -1].copy()
            for lf in froms:
                live = seen[t0:t1, lf] > 0
                match = np.full((b, self.matches), -1, dtype=np.int64)
                if live.any():
                    match[live] = top_matches(dots[live, lf] / self._norms[:n], self.matches)
                for pair in by_from[lf]:
                    lt = pair[1]
                    rows = self._rows[lt]
                    acc = np.zeros((b, n_e), dtype=np.float64)
                    for j in range(self.matches):
                        has = match[:, j] >= 0
                        acc[has] += rows[match[has, j]]
                    scores = acc * (1.0 - (lt - lf) / n_l) + terms[lt]
                    out[pair][t0:t1] = scores
        self.begin_request()
        self._query = request_eam(ex, n_e)
        self._qq = float(np.sum(self._query * self._query))
        self.end_request()
        return out
