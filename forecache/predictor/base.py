"""The interface every expert predictor implements (it reads traces as ``trace.format.Request``).

Time model (the same online and in evaluation): a request is processed token by token; at token t,
the layers run in order and layer l's routed experts become known at its gate. A prediction made at
layer ``layer_from`` for ``layer_to`` (> layer_from) may use every layer of tokens < t, and layers
<= layer_from of token t (its gate input there, its routed experts there, its token id).

Online use (the runtime's prefetcher, the simulator)::

    p.begin_request()
    for each token: p.begin_token(token_id)
                    for l in layers: p.observe(l, experts_l)
                                     scores = p.predict(l, l + k, hidden=x_l)
    p.end_request()

``score_request`` gives the predictions for a whole request at once, for evaluation; the default
runs the online path, and a subclass that overrides it for speed must return the same scores.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import numpy as np

from forecache.trace.format import Request


def source_layer(layer_to: int, window: int) -> int:
    """The layer whose gate predicts ``layer_to`` at window k (ProMoE: i - k, or 0 when i < k)."""
    return max(layer_to - window, 0)


def layer_prior(requests: Iterable[Request], n_layers: int, n_expert: int) -> np.ndarray:
    """Share of routed slots per (layer, expert) over ``requests``: [L, E], rows sum to 1
    (uniform for a layer with no known routes)."""
    counts = np.zeros((n_layers, n_expert), dtype=np.float64)
    for req in requests:
        ex = req.experts.astype(np.int64)
        for layer in range(n_layers):
            ids = ex[:, layer].ravel()
            np.add.at(counts[layer], ids[ids >= 0], 1.0)
    totals = counts.sum(axis=1, keepdims=True)
    return np.where(totals > 0, counts / np.maximum(totals, 1.0), 1.0 / n_expert)


class Predictor:
    """Scores the experts of a coming layer; higher means more likely routed.

    Subclasses set ``name`` and ``needs`` (trace arrays they require: "gate_input",
    "token_ids"), implement ``predict`` and keep their per-request state in ``begin_request`` /
    ``begin_token`` / ``observe``. ``fit`` learns from training requests; the base class
    learns the per-layer popularity prior, which subclasses add (scaled small) to break ties.
    """

    name: ClassVar[str] = "base"
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, n_layers: int, n_expert: int, top_k: int) -> None:
        self.n_layers = n_layers
        self.n_expert = n_expert
        self.top_k = top_k
        self.prior = np.full((n_layers, n_expert), 1.0 / n_expert)

    # -- training -------------------------------------------------------------------------------
    def fit(self, requests: Sequence[Request]) -> None:
        """Learn from training requests (held out from evaluation by the caller)."""
        self.prior = layer_prior(requests, self.n_layers, self.n_expert)

    # -- online ---------------------------------------------------------------------------------
    def begin_request(self) -> None:
        """A new request starts: forget per-request state."""

    def end_request(self) -> None:
        """The current request has finished (a predictor may learn from it online)."""

    def begin_token(self, token_id: int | None) -> None:
        """A new token enters the model (its id, when known)."""

    def observe(self, layer: int, experts: np.ndarray) -> None:
        """The current token's routed experts at ``layer`` ([k] ids; -1 = unknown)."""

    def predict(self, layer_from: int, layer_to: int, *, hidden: np.ndarray | None = None,
                ) -> np.ndarray:
        """Scores [E] for ``layer_to`` of the current token, made at ``layer_from``'s gate;
        ``hidden`` is the gate input of ``layer_from`` ([d]), for predictors that need it."""
        raise NotImplementedError

    # -- evaluation -----------------------------------------------------------------------------
    def score_request(self, req: Request, pairs: Sequence[tuple[int, int]],
                      ) -> dict[tuple[int, int], np.ndarray]:
        """Scores [T, E] for every (layer_from, layer_to) pair over one request, replaying the
        online path token by token (the reference a vectorised override must match)."""
        out = {pair: np.zeros((req.n_tokens, self.n_expert), dtype=np.float32) for pair in pairs}
        by_from: dict[int, list[tuple[int, int]]] = {}
        for pair in pairs:
            by_from.setdefault(pair[0], []).append(pair)
        self.begin_request()
        for t in range(req.n_tokens):
            self.begin_token(None if req.token_ids is None else int(req.token_ids[t]))
            for layer in range(self.n_layers):
                self.observe(layer, req.experts[t, layer])
                for pair in by_from.get(layer, ()):
                    hidden = None if req.gate_input is None else req.gate_input[t, layer]
                    out[pair][t] = self.predict(layer, pair[1], hidden=hidden)
        self.end_request()
        return out


def top_experts(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores along the last axis (ties: lower index first)."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[..., :k]
