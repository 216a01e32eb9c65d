"""MoBiLE in the simulator: little passes over a token's top experts, a share of tokens
recomputed by the big pass after prefetching what the little pass's router chose."""

from __future__ import annotations

from dataclasses import replace

from forecache.cache.cost import Profile
from forecache.cache.prefetcher import Features
from forecache.predictor.history import HistoryPredictor
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig, Simulator, simulate
from forecache.trace.format import logged_layers
from tests.test_prefetch import _requests


def test_little_passes_and_fallbacks() -> None:
    shape = shape_of("reference", "q8_0")
    profile = Profile.load("rtx4090")
    reqs = _requests()
    base = SimConfig("promoe", n_slots=10, n_ubatch=8, features=Features(split=False))

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


def test_speculative_steps() -> None:
    """Speculative decoding replayed: k drafts and one k+1-row verification a step, accepted
    until the first rejection; a model draft's memory comes out of the slots."""
    shape = shape_of("reference", "q8_0")
    profile = Profile.load("rtx4090")
    reqs = _requests()
    base = SimConfig("promoe", n_slots=10, n_ubatch=8, features=Features(split=False))

    def run(**kw: object) -> dict:
        return simulate(reqs, shape, profile, replace(base, **kw),
                        HistoryPredictor(8, 32, 4)).to_json()

    n_decode = sum(int((r.phase == 1).sum()) for r in reqs)
    exact = run()
    every = run(spec_draft="little", little_k=2, spec_k=3, spec_accept=1.0)
    # each step yields k + 1 tokens (fewer at a request's end): every decode token is timed once
    assert every["n_decode_tokens"] == n_decode
    assert every["spec_accepted"] + every["spec_steps"] == n_decode
    assert every["tokens_per_step"] > 3.0
    never = run(spec_draft="little", little_k=2, spec_k=3, spec_accept=0.0)
    assert never["tokens_per_step"] == 1.0 and never["tpot_s"] > every["tpot_s"]
    assert run(spec_draft="little", little_k=2, spec_k=3, spec_accept=0.7) == \
        run(spec_draft="little", little_k=2, spec_k=3, spec_accept=0.7)  # seeded
    # a model draft: its weights take slots, and it names the verifier's experts while it runs
    free = run(spec_draft="model", draft_bytes=0.0, spec_k=3, spec_accept=0.8)
    heavy = run(spec_draft="model", draft_bytes=4 * shape.expert_bytes, spec_k=3,
                spec_accept=0.8)
    assert heavy["hit_rate"] < free["hit_rate"]
    blind = run(spec_draft="model", draft_bytes=0.0, spec_k=3, spec_accept=0.8, spec_cutoff=0)
    assert blind["prefetch_loads"] < free["prefetch_loads"]
    # the acceptance draws are the drafts' own: the same steps whatever the prefetch draws
    assert blind["spec_accepted"] == free["spec_accepted"] == heavy["spec_accepted"]
    # stock's --n-cpu-moe with the same draft: its weights leave a layer's experts on the host
    layers = logged_layers(reqs, shape.layers)
    stock = replace(base, policy="ncmoe", n_slots=shape.experts)  # every layer on the device
    drafted = replace(stock, spec_draft="model", spec_k=3, spec_accept=0.8,
                      draft_bytes=shape.experts * shape.expert_bytes)
    assert not Simulator(shape, profile, stock, layers).stock_host
    assert len(Simulator(shape, profile, drafted, layers).stock_host) == 1
    assert simulate(reqs, shape, profile, drafted).to_json()["spec_accepted"] == \
        free["spec_accepted"]
    assert exact["n_decode_tokens"] == n_decode
