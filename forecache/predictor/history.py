"""Recency baseline: a layer's next experts are the ones this request used there most recently.

Score of expert e at ``layer_to`` for token t: ``sum_{s < t, e routed at (s, layer_to)}
decay**(t - 1 - s)``, plus the layer's popularity prior scaled by ``prior_weight`` (ties, and the
first token of a request, fall back to the prior). It reads nothing of token t itself, so the
prediction is the same for every ``layer_from``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from forecache.predictor.base import Predictor
from forecache.trace.format import Request


class HistoryPredictor(Predictor):
    """Exponentially decayed per-request counts of the experts routed at the target layer."""

    name = "history"
    needs = ()

    def __init__(self, n_layers: int, n_expert: int, top_k: int, *, decay: float = 0.5,
                 prior_weight: float = 1e-3) -> None:
        """``decay`` in [0, 1]: weight of a token one step older (0.5: recency dominates; 1:
        plain counts)."""
        super().__init__(n_layers, n_expert, top_k)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1] (got {decay})")
        self.decay = float(decay)
        self.prior_weight = float(prior_weight)
        self._hist = np.zeros((n_layers, n_expert), dtype=np.float64)

    def begin_request(self) -> None:
        """Forget the previous request's history."""
        self._hist = np.zeros((self.n_layers, self.n_expert), dtype=np.float64)

    def observe(self, layer: int, experts: np.ndarray) -> None:
        """Age ``layer``'s history by one token, then count this token's known experts."""
        row = self._hist[layer]
        row *= self.decay  # every token ages the history, known routes or not
        ids = np.asarray(experts, dtype=np.int64)
        np.add.at(row, ids[ids >= 0], 1.0)

    def predict(self, layer_from: int, layer_to: int, *, hidden: np.ndarray | None = None,
                ) -> np.ndarray:
        """Scores [E] for ``layer_to``; ``layer_to`` is not yet observed for the current token,
        so its history holds tokens < t only."""
        return self._hist[layer_to] + self.prior_weight * self.prior[layer_to]

    def score_request(self, req: Request, pairs: Sequence[tuple[int, int]],
                      ) -> dict[tuple[int, int], np.ndarray]:
        """Vectorised over layers and experts (one step per token); the same floating-point
        operations as the online path, so the same scores."""
        n_tok = req.n_tokens
        targets = sorted({lt for _, lt in pairs})
        snap = np.zeros((n_tok, len(targets), self.n_expert), dtype=np.float64)
        ex = req.experts.astype(np.int64)
        layer_of = np.broadcast_to(np.arange(self.n_layers)[:, None], ex.shape[1:])
        hist = np.zeros((self.n_layers, self.n_expert), dtype=np.float64)
        for t in range(n_tok):
            snap[t] = hist[targets]
            hist *= self.decay
            known = ex[t] >= 0
            # add.at in row-major order: the same per-cell additions as observe
            np.add.at(hist, (layer_of[known], ex[t][known]), 1.0)
        self._hist = hist
        self.end_request()
        col = {lt: j for j, lt in enumerate(targets)}
        return {pair: (snap[:, col[pair[1]]] + self.prior_weight * self.prior[pair[1]])
                .astype(np.float32) for pair in pairs}
