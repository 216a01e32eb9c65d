"""Token-based prediction (ProMoE section 4.2, after MoE-Infinity's early design and Pre-gated
MoE): the input token id alone predicts every layer of its iteration.

``fit`` counts, per token id seen in training, how often each expert was routed at each layer; a
prediction for ``layer_to`` is that token's normalised row there plus the layer's popularity prior
scaled by ``prior_weight`` (an unseen token, or a layer without data for it, gets the prior). The
prediction does not depend on ``layer_from``, so it can be made before the iteration starts
(iteration-wise prefetch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from forecache.predictor.base import Predictor
from forecache.trace.format import Request


class TokenPredictor(Predictor):
    """Per-token-id routing frequencies learned from training traces."""

    name = "token"
    needs = ("token_ids",)

    def __init__(self, n_layers: int, n_expert: int, top_k: int, *,
                 prior_weight: float = 1e-3) -> None:
        """``prior_weight``: scale of the popularity prior added to every prediction."""
        super().__init__(n_layers, n_expert, top_k)
        self.prior_weight = float(prior_weight)
        # Sparse over the vocabulary: only ids seen in training get a [L, E] row.
        self.known_ids = np.zeros(0, dtype=np.int64)  # sorted
        self.table = np.zeros((0, n_layers, n_expert), dtype=np.float32)  # rows sum to 1 (or 0)
        self._row = -1

    @property
    def n_known(self) -> int:
        """Number of distinct token ids with a learned row."""
        return int(self.known_ids.size)

    def fit(self, requests: Sequence[Request]) -> None:
        """Learn the prior and the per-token routing shares; requests without token ids only
        feed the prior."""
        super().fit(requests)
        with_ids = [r for r in requests if r.token_ids is not None and r.n_tokens > 0]
        if not with_ids:
            self.known_ids = np.zeros(0, dtype=np.int64)
            self.table = np.zeros((0, self.n_layers, self.n_expert), dtype=np.float32)
            return
        tok = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in with_ids])
        ex = np.concatenate([r.experts.astype(np.int64) for r in with_ids])
        self.known_ids, row = np.unique(tok, return_inverse=True)
        row = row.reshape(-1)
        n_l, n_e = self.n_layers, self.n_expert
        cell = (row[:, None, None] * n_l + np.arange(n_l)[None, :, None]) * n_e + ex
        cell = cell[ex >= 0]
        # Counting via unique avoids a float64 bincount the size of the whole table.
        uniq, cnt = np.unique(cell, return_counts=True)
        table = np.zeros((self.known_ids.size, n_l, n_e), dtype=np.float32)
        table.reshape(-1)[uniq] = cnt
        sums = table.sum(axis=2, keepdims=True)
        np.divide(table, sums, out=table, where=sums > 0)
        self.table = table

    def _lookup(self, token_ids: np.ndarray) -> np.ndarray:
        """Row of each id in ``table``, -1 where unseen."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if self.known_ids.size == 0:
            return np.full(ids.shape, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.known_ids, ids), self.known_ids.size - 1)
        return np.where(self.known_ids[pos] == ids, pos, -1)

    def begin_request(self) -> None:
        """No per-request state beyond the current token."""
        self._row = -1

    def begin_token(self, token_id: int | None) -> None:
        """Look the token's row up once for all of its layers."""
        self._row = -1 if token_id is None else int(self._lookup(np.array([token_id]))[0])

    def predict(self, layer_from: int, layer_to: int, *, hidden: np.ndarray | None = None,
                ) -> np.ndarray:
        """Scores [E] for ``layer_to`` from the current token id (``layer_from`` unused)."""
        term = self.prior_weight * self.prior[layer_to]
        if self._row < 0:
            return term
        return self.table[self._row, layer_to] + term

    def score_request(self, req: Request, pairs: Sequence[tuple[int, int]],
                      ) -> dict[tuple[int, int], np.ndarray]:
        """Vectorised over tokens; the same arithmetic as ``predict``, so the same scores."""
        n_tok = req.n_tokens
        rows = (np.full(n_tok, -1, dtype=np.int64) if req.token_ids is None
                else self._lookup(req.token_ids))
        seen = rows >= 0
        out: dict[tuple[int, int], np.ndarray] = {}
        for pair in pairs:
            lt = pair[1]
            scores = np.empty((n_tok, self.n_expert), dtype=np.float64)
            term = self.prior_weight * self.prior[lt]
            scores[:] = term
            scores[seen] = self.table[rows[seen], lt] + term
            out[pair] = scores.astype(np.float32)
        self._row = int(rows[-1]) if n_tok else -1  # the state the online path would leave
        self.end_request()
        return out
