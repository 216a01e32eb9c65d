"""The learned (MLP) predictor: training, ONNX export and run, vectorised scoring, persistence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forecache.predictor.base import Predictor, source_layer, top_experts
from forecache.predictor.learned import LearnedPredictor, onnx_file
from forecache.predictor.mlp import (
    HIDDEN_MAX,
    HIDDEN_MIN,
    OnnxMLP,
    export_onnx,
    hidden_size,
    train_mlp,
)
from forecache.trace.format import Request

N_LAYERS, N_EXPERT, TOP_K, D_MODEL, WINDOW = 4, 16, 4, 32, 2
PAIRS = [(source_layer(i, WINDOW), i) for i in range(1, N_LAYERS)]


def synthetic_requests(n_requests: int, n_tokens: int, seed: int = 0) -> list[Request]:
    """Requests whose layer-i routing is the top-k of A_i @ (gate input of layer i - WINDOW)."""
    mats = np.random.default_rng(1234).standard_normal((N_LAYERS, N_EXPERT, D_MODEL))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_requests):
        gate = rng.standard_normal((n_tokens, N_LAYERS, D_MODEL)).astype(np.float16)
        experts = np.empty((n_tokens, N_LAYERS, TOP_K), dtype=np.int16)
        for layer in range(N_LAYERS):
            src = gate[:, source_layer(layer, WINDOW)].astype(np.float64)
            experts[:, layer] = top_experts(src @ mats[layer].T, TOP_K)
        out.append(Request(experts=experts, gate_input=gate))
    return out


@pytest.fixture(scope="module")
def trained() -> LearnedPredictor:
    p = LearnedPredictor(N_LAYERS, N_EXPERT, TOP_K, pairs=PAIRS, d_model=D_MODEL)
    p.fit(synthetic_requests(12, 1000, seed=0))
    return p


def accuracy(scores: np.ndarray, truth: np.ndarray) -> float:
    """Share of the true top-k ([T, k]) that the predicted top-k contains."""
    pred = top_experts(scores, truth.shape[1])
    return float((pred[:, :, None] == truth[:, None, :]).any(axis=1).mean())


def test_onnx_matches_numpy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 48)).astype(np.float16) * 3 + 1
    y = np.argsort(rng.standard_normal((2000, 12)), axis=1)[:, :3]
    mlp, stats = train_mlp(x, y, 12, 64, epochs=3, seed=0)
    assert stats["epochs"] >= 1 and stats["n_val"] == 200
    path = tmp_path / "m.onnx"
    export_onnx(mlp, path)
    sess = OnnxMLP(path)
    probe = rng.standard_normal((64, 48)).astype(np.float32) * 3 + 1
    np.testing.assert_allclose(sess.run(probe), mlp.forward(probe), rtol=0, atol=1e-5)
    np.testing.assert_allclose(sess.run(probe[:1]), mlp.forward(probe[:1]), rtol=0, atol=1e-5)


def test_train_drops_unknown_rows_and_is_deterministic() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, 16)).astype(np.float32)
    y = np.argsort(rng.standard_normal((500, 8)), axis=1)[:, :2]
    y[:100] = -1
    a, sa = train_mlp(x, y, 8, 64, epochs=2, seed=3)
    b, _ = train_mlp(x, y, 8, 64, epochs=2, seed=3)
    assert sa["n_train"] + sa["n_val"] == 400
    np.testing.assert_array_equal(a.w1, b.w1)


def test_learns_routing_function(trained: LearnedPredictor) -> None:
    for pair, stats in trained.train_stats.items():
        assert stats["val_accuracy"] >= 0.85, (pair, stats)
    held_out = synthetic_requests(2, 500, seed=99)
    rng = np.random.default_rng(5)
    for req in held_out:
        scores = trained.score_request(req, PAIRS)
        for (a, b), s in scores.items():
            truth = req.experts[:, b].astype(np.int64)
            assert accuracy(s, truth) >= 0.9, (a, b)
            chance = accuracy(rng.standard_normal(s.shape), truth)
            assert chance < 0.4  # k/E = 0.25 expected


def test_score_request_matches_online_path(trained: LearnedPredictor) -> None:
    req = synthetic_requests(1, 40, seed=7)[0]
    fast = trained.score_request(req, PAIRS)
    slow = Predictor.score_request(trained, req, PAIRS)
    for pair in PAIRS:
        np.testing.assert_allclose(fast[pair], slow[pair], rtol=0, atol=1e-5)


def test_predict_errors(trained: LearnedPredictor) -> None:
    with pytest.raises(ValueError, match="hidden"):
        trained.predict(*PAIRS[0])
    with pytest.raises(KeyError, match=r"\(0, 3\)"):
        trained.predict(0, 3, hidden=np.zeros(D_MODEL, dtype=np.float16))


def test_save_load_round_trip(trained: LearnedPredictor, tmp_path: Path) -> None:
    trained.save(tmp_path / "pred")
    loaded = LearnedPredictor.load(tmp_path / "pred")
    assert loaded.pairs == trained.pairs and loaded.hidden == trained.hidden
    assert loaded.train_stats[PAIRS[0]]["epochs"] == trained.train_stats[PAIRS[0]]["epochs"]
    np.testing.assert_array_equal(loaded.prior, trained.prior)
    req = synthetic_requests(1, 30, seed=11)[0]
    a, b = trained.score_request(req, PAIRS), loaded.score_request(req, PAIRS)
    for pair in PAIRS:
        np.testing.assert_array_equal(a[pair], b[pair])
    assert not list((tmp_path / "pred").glob("*.tmp"))


def test_load_rejects_corrupt_or_missing(trained: LearnedPredictor, tmp_path: Path) -> None:
    d = tmp_path / "pred"
    trained.save(d)
    target = d / onnx_file(*PAIRS[1])
    target.write_bytes(b"not an onnx model")
    with pytest.raises(ValueError, match=onnx_file(*PAIRS[1])):
        LearnedPredictor.load(d)
    target.unlink()
    with pytest.raises(ValueError, match="retrain"):
        LearnedPredictor.load(d)
    with pytest.raises(ValueError, match="learned.json"):
        LearnedPredictor.load(tmp_path / "nothing-here")


@pytest.mark.parametrize("d_model,n_expert", [(1, 1), (32, 16), (256, 16), (2048, 60),
                                              (2048, 64), (3584, 64), (4096, 8), (7168, 256),
                                              (65536, 512)])
def test_hidden_size_bounds(d_model: int, n_expert: int) -> None:
    h = hidden_size(d_model, n_expert)
    assert HIDDEN_MIN <= h <= HIDDEN_MAX and h % 32 == 0
    if d_model * HIDDEN_MIN <= 1 << 20:
        assert d_model * h <= 1 << 20  # the latency cap


def test_hidden_size_reference_shapes() -> None:
    assert hidden_size(256, 16) == 128
    assert hidden_size(3584, 64) == 288
    with pytest.raises(ValueError):
        hidden_size(0, 8)
