"""The decode gate: one-token gates decided in C from the policy's tables, as its Python gate
decides them, with gate events delivered to the prediction thread from C."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from split_costs import split_costs

from forecache.cache.infinity import InfinityPolicy
from forecache.cache.prefetcher import Features, ProMoEPolicy
from forecache.cache.runtime import ExpertCache
from forecache.generate import SamplingParams, generate
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.native.testing import ChunkInfo, controls
from forecache.placement.options import CacheConfig
from forecache.sim.shapes import shape_of


def _schedule(cache: ExpertCache, layer: int) -> tuple[list[int], list[int]]:
    n = cache.layers[layer].n_expert
    e, s = (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)()
    k = controls().cache_test_schedule(cache.handle, layer, e, s)
    return e[:k], s[:k]


def _step(cache: ExpertCache, n: int) -> None:
    """Run up to ``n`` queued chunks on this thread (the copy worker is paused)."""
    info = ChunkInfo()
    for _ in range(n):
        if controls().cache_step(cache.handle, info) != 0:
            return


def _state(cache: ExpertCache, layers: range) -> list:
    return [(cache.layer_state(il)[0].tolist(), cache.layer_state(il)[1].tolist(),
             cache.resident_order(il)) for il in layers]


@pytest.mark.parametrize("policy", ["promoe", "infinity"])
def test_decode_gate_decides_as_the_python_gate(policy: str,
                                                tiny_model: Callable[[str], Path]) -> None:
    """The same routings, copies and predictions through two caches, one deciding one-token
    gates in C and one calling the policy: the same schedules, slots, states and eviction
    order (recency, and infinity's keys: request and all-time rows, predicted rank)."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    k, n_layer, n_slots = mf.n_expert_used, mf.n_layer, 6
    cfg = CacheConfig("lru", slots_per_layer=n_slots)
    with Llama.open(model, n_ctx=256, cache=cfg) as a_llm, \
            Llama.open(model, n_ctx=256, cache=cfg) as b_llm:
        a, b = a_llm.expert_cache, b_llm.expert_cache
        assert a is not None and b is not None
        shape = shape_of("tiny", "q8_0").expert
        make = ProMoEPolicy if policy == "promoe" else InfinityPolicy
        pol_a = make([n_slots] * n_layer, Features(), split_costs(shape))
        pol_b = make([n_slots] * n_layer, Features(), split_costs(shape))
        table = pol_a.decode_gate(k)
        assert table is not None
        host_k = table[0]
        assert max(host_k) >= 1 and 0 in host_k  # some gates split, some do not
        for c, pol in ((a, pol_a), (b, pol_b)):
            c.policy = pol
            pol.attach(c)
            controls().cache_pause(c.handle, True)
        b.use_decode_gate(False)
        a._decode_gate(k)  # C decides A's one-token gates; B calls the policy for every gate
        rng = np.random.default_rng(3)
        hot = [rng.permutation(mf.n_expert)[:n_slots + 2] for _ in range(n_layer)]
        seen_host = seen_flight = 0
        for token in range(40):
            if token == 20:  # a new request: infinity forgets the request's rows and ranks
                pol_a.begin_request()
                pol_b.begin_request()
            for il in range(n_layer):
                experts = rng.choice(hot[il], size=k, replace=False).tolist()
                arr = (ctypes.c_int32 * k)(*experts)
                rc = controls().cache_test_route(a.handle, il, arr, k, True)
                on_a = rc == 0 if rc != 2 else pol_a.gate(il, np.array(experts), a, np.ones(k))
                assert controls().cache_test_route(b.handle, il, arr, k, False) == 2
                on_b = pol_b.gate(il, np.array(experts), b, np.ones(k))
                assert on_a == on_b
                sch = _schedule(a, il)
                assert sch == _schedule(b, il), (il, experts)
                seen_host += sch[1].count(-1)
                seen_flight += sum(1 for s in a.layer_state(il)[1].tolist() if s > 0)
                # a prediction for the next layer, then part of the queued copies run
                nxt = (il + 1) % n_layer
                guess = rng.choice(hot[nxt], size=k, replace=False).tolist()
                cur = a.passes(nxt)[0]
                assert pol_a.prefetch(nxt, guess, cur, a) == pol_b.prefetch(nxt, guess, cur, b)
                steps = int(rng.integers(0, 12))
                _step(a, steps)
                _step(b, steps)
                assert _state(a, range(n_layer)) == _state(b, range(n_layer))
                assert np.array_equal(a.layer_keys(il), b.layer_keys(il))
        sa, sb = a.stats(), b.stats()
        assert sa["decode_gates"] > 0 and sb["decode_gates"] == 0
        assert seen_host > 0 and seen_flight > 0  # the split and in-flight cases were met
        for key in ("hits", "misses", "host_entries", "dropped_chunks", "refused_loads"):
            assert sa[key] == sb[key], key
        for c in (a, b):
            controls().cache_pause(c.handle, False)


@pytest.mark.parametrize("policy", ["promoe", "infinity"])
def test_decode_runs_in_c_and_predictions_come_from_c(policy: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      tiny_model: Callable[[str], Path]) -> None:
    """A promoe or infinity run decodes without the Python hook: the hook is called for
    prefill ubatches only, predictions still reach the cache (from C's gate events), and the
    tokens are those of the same run with every gate in Python."""
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))  # infinity's collection
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 8, 16, 32, 64]]
    n_gen = 24

    def run(in_c: bool) -> tuple[list[list[int]], dict, tuple[int, int], int]:
        cfg = CacheConfig(policy, cache_fraction=0.5,
                          predictor="history" if policy == "promoe" else "auto")
        with Llama.open(model, n_ctx=256, cache=cfg) as llm:
            cache = llm.expert_cache
            assert cache is not None
            cache.use_decode_gate(in_c)
            out = [generate(llm, p, n_gen, SamplingParams(greedy=True), ignore_eos=True).tokens
                   for p in prompts]
            assert cache.worker is not None
            cache.worker.drain()
            stats = cache.stats()
            pol = cache.policy
            # forecasts made from C's gate events reached the policy (copied, refreshed, or too
            # late: which depends on how busy the cores are)
            forecasts = pol.prefetch_loads + pol.prefetch_refreshed + pol.stale_predictions
            return out, stats, cache.decode_counts(), forecasts

    toks_c, stats_c, counts_c, forecasts_c = run(True)
    toks_py, stats_py, counts_py, forecasts_py = run(False)
    assert toks_c == toks_py
    n_moe = len(mf.moe_layers())
    decode_gates = len(prompts) * (n_gen - 1) * n_moe
    # every gate of one token is decided in C: the decode's, and a prefill's last layer (it
    # routes only the row whose logits are wanted); the hook sees the other prefill gates
    one_row = len(prompts)
    assert stats_c["decode_gates"] == decode_gates + one_row
    assert stats_c["hook_calls"] == len(prompts) * n_moe - one_row
    assert stats_py["decode_gates"] == 0
    assert stats_py["hook_calls"] == stats_c["hook_calls"] + stats_c["decode_gates"]
    assert sum(counts_c) == stats_c["decode_gates"] * mf.n_expert_used
    assert stats_c["events_dropped"] == 0
    if policy == "promoe":  # infinity's empty EAM collection may match nothing yet
        assert forecasts_c > 0
    json.dumps(stats_c)
