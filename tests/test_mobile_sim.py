"""MoBiLE in the simulator: little passes over a token's top experts, a share of tokens
recomputed by the big pass after prefetching what the little pass's router chose."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from forecache.cache.cost import Profile
from forecache.cache.prefetcher import Features
from forecache.predictor.history import HistoryPredictor
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig, simulate
from forecache.trace.format import Request


def _requests(n_req: int = 3, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    L, E, k, T = 8, 32, 4, 48
    out = []
    for _ in range(n_req):
        ex = np.zeros((T, L, k), np.int16)
        for t in range(T):
            for il in range(L):
                keep = ex[t - 1, il, :2] if t else rng.choice(E, 2, replace=False)
                rest = rng.choice(np.setdiff1d(np.arange(E), keep), k - 2, replace=False)
                ex[t, il] = np.r_[keep, rest]
        phase = np.r_[np.zeros(16, np.int8), np.ones(T - 16, np.int8)]
        out.append(Request(experts=ex, token_ids=rng.integers(0, 100, T).astype(np.int32),
                           phase=phase))
    return out


def test_little_passes_and_fallbacks() -> None:
    shape = shape_of("reference", "q8_0")
    profile = Profile.load("rtx4090")
    reqs = _requests()
    base = SimConfig("promoe", n_slots=10, n_ubatch=16, features=Features(split=False))

    def run(**kw: object) -> dict:
        return simulate(reqs, shape, profile, replace(base, **kw),
                        HistoryPredictor(8, 32, 4)).to_json()

    exact = run()
    n_decode = sum(int((r.phase == 1).sum()) for r in reqs)
    little = run(little_k=2)
    assert little["little_passes"] == n_decode and little["big_passes"] == 0
    assert little["tpot_s"] < exact["tpot_s"]
    # every routed expert of a little pass is one of the token's top 2: half the lookups
    assert little["hits"] + little["misses"] < exact["hits"] + exact["misses"]
    half = run(little_k=2, fallback=0.5)
    assert 0 < half["big_passes"] < n_decode
    assert little["tpot_s"] < half["tpot_s"]
    # the same seed falls back on the same tokens
    assert run(little_k=2, fallback=0.5) == half
    everyone = run(little_k=2, fallback=1.0)
    assert everyone["big_passes"] == n_decode and everyone["tpot_s"] > exact["tpot_s"]
    # the big pass starts by prefetching the little pass's choice: those copies are queued
    assert everyone["prefetch_loads"] > exact["prefetch_loads"]
    resident = run(little_k=4, little_resident=True)
    assert resident["hit_rate"] > exact["hit_rate"]
