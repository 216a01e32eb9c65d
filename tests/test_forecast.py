"""The forecast thread: predictions reach the policy, and a failing predictor is reported once."""

from __future__ import annotations

import numpy as np

from forecache.cache.forecast import Forecaster, ForecastWorker
from forecache.predictor.history import HistoryPredictor

N_LAYERS, N_EXPERT, TOP_K = 4, 8, 2


class BrokenPredictor(HistoryPredictor):
    """History predictions until ``fail_after`` predictions have been made, then an error."""

    def __init__(self, fail_after: int) -> None:
        super().__init__(N_LAYERS, N_EXPERT, TOP_K)
        self.calls = 0
        self.fail_after = fail_after

    def predict(self, layer_from: int, layer_to: int, **kw: object) -> np.ndarray:
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("onnxruntime session lost")
        return super().predict(layer_from, layer_to, **kw)


def _run(predictor: HistoryPredictor, n_tokens: int) -> tuple[list, list[str], ForecastWorker]:
    applied: list[tuple[int, list[int], int]] = []
    said: list[str] = []
    fc = Forecaster(predictor, 1, list(range(N_LAYERS)), [N_EXPERT] * N_LAYERS)
    worker = ForecastWorker(fc, lambda t, e, p: applied.append((t, e.tolist(), p)), said.append)
    rng = np.random.default_rng(0)
    worker.begin_request()
    for tok in range(n_tokens):
        for layer in range(N_LAYERS):
            ids = rng.choice(N_EXPERT, size=(1, TOP_K), replace=False).astype(np.int32)
            worker.submit(layer, ids, None, None, tok)
    worker.end_request()
    worker.drain()
    worker.close()
    return applied, said, worker


def test_forecasts_reach_the_policy() -> None:
    applied, said, worker = _run(BrokenPredictor(fail_after=10**9), 5)
    # every layer but the first is predicted from the one before, once per token
    assert len(applied) == 5 * (N_LAYERS - 1)
    assert all(len(e) == TOP_K and t >= 1 for t, e, _ in applied)
    assert not said and not worker.errors


def test_failing_predictor_stops_forecasting_and_says_so_once() -> None:
    predictor = BrokenPredictor(fail_after=4)
    applied, said, worker = _run(predictor, 6)
    assert len(applied) == 4  # the forecasts before the failure were applied
    assert len(worker.errors) == 1 and isinstance(worker.errors[0], RuntimeError)
    assert len(said) == 1
    assert "history predictor failed" in said[0] and "onnxruntime session lost" in said[0]
    assert predictor.calls == 5  # no prediction is tried after the failure
