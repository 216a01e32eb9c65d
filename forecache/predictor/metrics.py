"""Prediction quality, as ProMoE (section 4.2) measures it.

``GOODPRED_i(k) = ACCURACY_i(k) x FETCHRATE_i(k)`` for target layer i predicted k layers ahead
(window k): ACCURACY is the share of the experts actually routed at layer i that the prediction
names; FETCHRATE is the share of the predicted experts that can be copied to the GPU before layer
i runs (a property of the runtime's timing, not of the predictor). The accuracy part is
``topk_accuracy``, pooled per (target layer, window) over the tokens of all evaluated requests:
sum the returned totals and counts, then divide.
"""

from __future__ import annotations

import numpy as np

from forecache.predictor.base import top_experts


def topk_accuracy(scores: np.ndarray, actual: np.ndarray) -> tuple[float, int]:
    """ACCURACY over tokens: per token, the share of the actually routed experts (``actual``
    [T, k]) found among the k highest ``scores`` [T, E] (ties: lower id first, as
    ``top_experts``). Rows of ``actual`` with any -1 are skipped. Returns (sum of the per-token
    shares, number of tokens counted), so callers can pool over requests."""
    actual = np.asarray(actual)
    scores = np.asarray(scores)
    if actual.ndim != 2 or scores.ndim != 2 or scores.shape[0] != actual.shape[0]:
        raise ValueError(f"scores [T, E] and actual [T, k] expected (got {scores.shape}, "
                         f"{actual.shape})")
    k = actual.shape[1]
    rows = np.flatnonzero((actual >= 0).all(axis=1)) if k else np.zeros(0, dtype=np.int64)
    if rows.size == 0:
        return 0.0, 0
    pred = top_experts(scores[rows], k)
    act = actual[rows].astype(np.int64)
    hit = (act[:, :, None] == pred[:, None, :]).any(axis=2)
    return float(hit.sum() / k), int(rows.size)
