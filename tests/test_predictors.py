"""History, token and EAM predictors and the accuracy metric, on synthetic traces with known
answers: accuracy where routing is determined, vectorised scoring equal to the online path, and
causality (a prediction never reads what the time model hides)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest

from forecache.predictor.base import Predictor, top_experts
from forecache.predictor.eam import EAMPredictor, request_eam, top_matches
from forecache.predictor.history import HistoryPredictor
from forecache.predictor.metrics import topk_accuracy
from forecache.predictor.token import TokenPredictor
from forecache.trace.format import Request

L, E, K = 6, 16, 2
ALL_PAIRS = [(lf, lt) for lt in range(1, L) for lf in range(lt)]
WINDOW_PAIRS = sorted({(max(i - w, 0), i) for i in range(1, L) for w in (1, 2, 4)})


def _accuracy(p: Predictor, reqs: list[Request], pairs: list[tuple[int, int]],
              skip_first_token: bool = False) -> float:
    total, count = 0.0, 0
    for req in reqs:
        scores = p.score_request(req, pairs)
        start = 1 if skip_first_token else 0
        for pair in pairs:
            s, c = topk_accuracy(scores[pair][start:], req.experts[start:, pair[1]])
            total += s
            count += c
    assert count > 0
    return total / count


def _random_request(rng: np.random.Generator, n_tok: int, vocab: np.ndarray) -> Request:
    """Random routes (distinct per cell) with unknown cells and unknown rows, random token ids."""
    ex = np.argsort(rng.random((n_tok, L, E)), axis=2)[:, :, :K].astype(np.int16)
    ex[rng.random((n_tok, L)) < 0.15] = -1
    ex[rng.random((n_tok, L, K)) < 0.05] = -1
    return Request(experts=ex, token_ids=rng.choice(vocab, n_tok).astype(np.int32))


def test_topk_accuracy_hand_example() -> None:
    scores = np.array([[0.9, 0.1, 0.5, 0.0],   # top-2 {0, 2}: both routed -> 1
                       [0.1, 0.2, 0.3, 0.4],   # top-2 {3, 2}: 3 of {0, 3} -> 1/2
                       [1.0, 1.0, 0.0, 0.0],   # skipped (actual has -1)
                       [0.5, 0.5, 0.5, 0.0]])  # ties: lower id first, top-2 {0, 1} -> 1/2
    actual = np.array([[2, 0], [0, 3], [-1, 1], [2, 1]])
    assert topk_accuracy(scores, actual) == (2.0, 3)
    assert topk_accuracy(scores[2:3], actual[2:3]) == (0.0, 0)


# -- token ------------------------------------------------------------------------------------
def _token_routing(rng: np.random.Generator, vocab: np.ndarray) -> dict[int, np.ndarray]:
    return {int(v): np.argsort(rng.random((L, E)), axis=1)[:, :K] for v in vocab}


def _token_request(rng: np.random.Generator, vocab: np.ndarray, route: dict[int, np.ndarray],
                   n_tok: int) -> Request:
    tok = rng.choice(vocab, n_tok)
    ex = np.stack([route[int(v)] for v in tok]).astype(np.int16)
    return Request(experts=ex, token_ids=tok.astype(np.int32))


def test_token_predictor_learns_token_routing() -> None:
    rng = np.random.default_rng(0)
    vocab = rng.choice(150_000, 30, replace=False)
    route = _token_routing(rng, vocab)
    train = [_token_request(rng, vocab, route, 200) for _ in range(3)]
    test = [_token_request(rng, vocab, route, 50) for _ in range(3)]
    p = TokenPredictor(L, E, K)
    p.fit(train)
    assert p.n_known == 30 and p.table.shape == (30, L, E)  # sparse over the vocabulary
    assert _accuracy(p, test, WINDOW_PAIRS) == 1.0

    unseen = int(np.setdiff1d(np.arange(150_000), vocab)[0])
    p.begin_request()
    p.begin_token(unseen)
    for lt in range(1, L):
        got = top_experts(p.predict(0, lt), K)
        assert np.array_equal(got, top_experts(p.prior[lt], K))


# -- history ----------------------------------------------------------------------------------
def test_history_predictor_repeats_the_requests_experts() -> None:
    rng = np.random.default_rng(1)
    reqs = []
    for _ in range(4):
        sets = np.argsort(rng.random((L, E)), axis=1)[:, :K]
        reqs.append(Request(experts=np.repeat(sets[None], 20, axis=0).astype(np.int16)))
    p = HistoryPredictor(L, E, K)
    p.fit(reqs[:1])
    assert _accuracy(p, reqs, ALL_PAIRS, skip_first_token=True) == 1.0


def test_history_predictor_recency() -> None:
    # layer 1 routes tokens 0, 1 to expert 0 and tokens 2, 3 to expert 1
    ex = np.array([[0, 0], [0, 0], [1, 1], [1, 1]], dtype=np.int16)[:, :, None]
    req = Request(experts=ex)
    recent = HistoryPredictor(2, 4, 1, decay=0.5).score_request(req, [(0, 1)])[(0, 1)]
    counts = HistoryPredictor(2, 4, 1, decay=1.0).score_request(req, [(0, 1)])[(0, 1)]
    assert top_experts(recent[2], 1)[0] == 0 and top_experts(counts[2], 1)[0] == 0
    # token 3: expert 1 one token ago (1.0) beats expert 0 (0.5 + 0.25); plain counts tie 2:1
    assert top_experts(recent[3], 1)[0] == 1 and top_experts(counts[3], 1)[0] == 0
    assert np.allclose(recent[3] - 1e-3 * 0.25, [0.75, 1.0, 0.0, 0.0])


# -- eam --------------------------------------------------------------------------------------
def _group_requests(rng: np.random.Generator, sets: np.ndarray, n_req: int,
                    noise: float = 0.02) -> list[Request]:
    """Requests of the groups in turn; a group routes every token to its own set per layer,
    but for a share ``noise`` of random (token, layer) cells."""
    reqs = []
    for i in range(n_req):
        g = i % len(sets)
        n_tok = int(rng.integers(5, 30))
        ex = np.repeat(sets[g][None], n_tok, axis=0).copy()
        noisy = rng.random((n_tok, L)) < noise
        ex[noisy] = np.argsort(rng.random((int(noisy.sum()), E)), axis=1)[:, :K]
        reqs.append(Request(experts=ex.astype(np.int16)))
    return reqs


def test_eam_predictor_matches_groups() -> None:
    rng = np.random.default_rng(2)
    n_group = 4
    # disjoint sets across groups at every layer
    perm = np.argsort(rng.random((L, E)), axis=1)
    sets = np.stack([perm[:, g * K:(g + 1) * K] for g in range(n_group)])
    train = _group_requests(rng, sets, 40)
    test = _group_requests(rng, sets, 12)
    p = EAMPredictor(L, E, K, capacity=1000, matches=3, learn_online=False)
    p.fit(train)
    assert p.collection_size == 40
    assert _accuracy(p, test, WINDOW_PAIRS) >= 0.95
    assert p.collection_size == 40
    p.learn_online = True
    p.score_request(test[0], WINDOW_PAIRS)
    assert p.collection_size == 41


def test_request_eam_counts_known_routes() -> None:
    ex = np.array([[[0, 1], [2, -1]], [[1, 0], [-1, -1]]], dtype=np.int16)  # [T=2, L=2, k=2]
    assert np.array_equal(request_eam(ex, 3), [[2, 2, 0], [0, 0, 1]])


def test_eam_capacity_replaces_most_similar() -> None:
    a = np.array([[5, 0, 0, 0], [0, 5, 0, 0]])
    b = np.array([[0, 0, 5, 0], [0, 0, 0, 5]])
    c = np.array([[0, 0, 4, 1], [0, 0, 1, 4]])  # close to b
    p = EAMPredictor(2, 4, 1, capacity=2)
    assert [p.add(a), p.add(b)] == [0, 1]
    assert p.add(c) == 1
    assert p.collection_size == 2
    assert np.array_equal(p.collection, np.stack([a, c]))
    d = np.array([[4, 1, 0, 0], [1, 4, 0, 0]])  # close to a
    assert p.add(d) == 0
    assert np.array_equal(p.collection, np.stack([d, c]))
    assert p.add(np.zeros((2, 4))) == -1  # nothing to match: not stored


def test_top_matches_is_a_stable_cut() -> None:
    rng = np.random.default_rng(3)
    sim = rng.integers(-2, 4, (50, 9)).astype(np.float64)  # many ties, some non-positive
    got = top_matches(sim, 3)
    for row, sel in zip(sim, got, strict=True):
        ref = [c for c in np.argsort(-row, kind="stable")[:3] if row[c] > 0]
        assert sel.tolist() == ref + [-1] * (3 - len(ref))


# -- all three: vectorised == online, causality --------------------------------------------
FACTORIES: dict[str, Callable[[], Predictor]] = {
    "history": lambda: HistoryPredictor(L, E, K),
    "history_decay1": lambda: HistoryPredictor(L, E, K, decay=1.0),
    "token": lambda: TokenPredictor(L, E, K),
    "eam": lambda: EAMPredictor(L, E, K, capacity=4, matches=3),
    "eam_empty": lambda: EAMPredictor(L, E, K, capacity=4),
}


def _fitted(kind: str, rng: np.random.Generator, vocab: np.ndarray) -> Predictor:
    p = FACTORIES[kind]()
    if kind != "eam_empty":
        p.fit([_random_request(rng, 30, vocab) for _ in range(6)])
    return p


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_vectorised_scores_equal_online_path(kind: str) -> None:
    rng = np.random.default_rng(4)
    vocab = rng.choice(150_000, 12, replace=False)
    p = _fitted(kind, rng, vocab)
    online, fast = copy.deepcopy(p), copy.deepcopy(p)
    # several requests in a row: the EAM learns each one online (capacity 4: replacements)
    for n_tok in (25, 1, 40, 17, 33):
        req = _random_request(rng, n_tok, vocab)
        want = Predictor.score_request(online, req, ALL_PAIRS)
        got = fast.score_request(req, ALL_PAIRS)
        for pair in ALL_PAIRS:
            assert got[pair].dtype == np.float32
            assert np.array_equal(got[pair], want[pair]), pair


@pytest.mark.parametrize("kind", list(FACTORIES))
@pytest.mark.parametrize("vectorised", [False, True])
def test_predictions_use_only_allowed_information(kind: str, vectorised: bool) -> None:
    rng = np.random.default_rng(5)
    vocab = rng.choice(150_000, 12, replace=False)
    p = _fitted(kind, rng, vocab)

    def score(req: Request) -> dict[tuple[int, int], np.ndarray]:
        q = copy.deepcopy(p)
        return q.score_request(req, ALL_PAIRS) if vectorised else Predictor.score_request(
            q, req, ALL_PAIRS)

    req = _random_request(rng, 30, vocab)
    base = score(req)
    for _ in range(12):
        t = int(rng.integers(req.n_tokens))
        lf = int(rng.integers(L - 1))
        other = _random_request(rng, req.n_tokens, vocab)
        ex = req.experts.copy()
        ex[t, lf + 1:] = other.experts[t, lf + 1:]
        ex[t + 1:] = other.experts[t + 1:]
        tok = req.token_ids.copy()
        tok[t + 1:] = other.token_ids[t + 1:]
        changed = score(Request(experts=ex, token_ids=tok))
        for pair in ALL_PAIRS:
            # earlier tokens never change; token t's only where predicted at lf or before
            if pair[0] <= lf:
                assert np.array_equal(changed[pair][:t + 1], base[pair][:t + 1]), (t, lf, pair)
            else:
                assert np.array_equal(changed[pair][:t], base[pair][:t]), (t, lf, pair)
