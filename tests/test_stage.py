"""Stage slots: device memory outside the layers' slots into which a streaming prompt pass copies
the next layer's missing experts, in the C engine, the simulator's engine and promoe's gate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from forecache.cache.cost import Profile
from forecache.cache.prefetcher import HIGH, LOW, SLOT_EMPTY, Features, stage_slots
from forecache.cache.runtime import CacheError
from forecache.generate import SamplingParams, generate, last_logits, text_tokens
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.native.testing import controls
from forecache.placement.options import CacheConfig
from forecache.predictor.history import HistoryPredictor
from forecache.sim.engine import SimEngine
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig, simulate
from forecache.trace.format import Request
from tests.conftest import assert_same_tokens
from tests.test_prefetch import N_BATCH, TEXT, _steps

if TYPE_CHECKING:
    from conftest import StockReference


def _stage_table(eng, layers: range) -> list:  # type: ignore[no-untyped-def]
    return [sorted(eng.staged(il).items()) for il in layers]


def test_stage_slots_in_c_follow_the_sim_engine(tiny_model: Callable[[str], Path]) -> None:
    """Staging, preemption, schedules that read stage slots and the release of those they do
    not read: the same stage and slot states, and the same copy order, in both engines."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    n = 4
    with Llama.open(model, n_ctx=256, cache=CacheConfig("lru", slots_per_layer=n)) as llm:
        cache = llm.expert_cache
        assert cache is not None
        cache.set_stage(3)
        with pytest.raises(CacheError, match="already set"):
            cache.set_stage(2)
        sim = SimEngine(shape_of("tiny", "q8_0"), [n] * mf.n_layer, Profile.load("rtx4090"),
                        n_stage=3)
        assert cache.stage_slots() == sim.stage_slots() == 3
        assert cache.n_experts(0) == sim.n_experts(0) == mf.n_expert
        sim.paused = True
        controls().cache_pause(cache.handle, True)
        script = [
            ("load", 1, 10, 0, LOW),
            ("stage", 1, 8, LOW), ("stage", 1, 9, LOW), ("stage", 1, 8, LOW),  # already staged
            ("stage", 1, 10, LOW),  # has a slot of the layer
            ("stage", 2, 3, LOW), ("stage", 2, 4, LOW),  # no stage slot free
            ("preempt", 2, []),  # drops layer 2's queued copies: its stage slot goes back
            ("stage", 2, 5, LOW),
            ("preempt", 1, [8, 9, 11]),  # the staged experts' copies move up
            # expert 8 from its stage slot (n + 0); 9's stage slot is not read and goes back
            ("schedule", 1, [10, 8, 11, 12, 13], [0, n + 0, 1, 2, 3]),
            ("stage", 3, 6, LOW),
        ]
        for op in script:
            if op[0] == "load":
                assert cache.load(*op[1:]) == sim.load(*op[1:])
            elif op[0] == "stage":
                assert cache.stage(*op[1:]) == sim.stage(*op[1:]), op
            elif op[0] == "preempt":
                assert cache.preempt(op[1], op[2]) == sim.preempt(op[1], op[2])
            else:
                assert cache.schedule(op[1], op[2], op[3], HIGH) == \
                    sim.schedule(op[1], op[2], op[3], HIGH) == 0
            assert _stage_table(cache, range(4)) == _stage_table(sim, range(4)), op
            for il in range(4):
                c, s = cache.layer_state(il), sim.layer_state(il)
                assert np.array_equal(c[0], s[0]) and np.array_equal(c[1], s[1]), (op, il)
        staged = {il: sorted(cache.staged(il)) for il in range(4)}
        assert staged == {0: [], 1: [8], 2: [5], 3: [6]}
        c_order = [(lay, slot, proj, e) for lay, slot, proj, e, _ in _steps(cache)]
        sim_order = []
        while (ch := sim._pop()) is not None:
            sim_order.append((ch.layer, ch.slot, ch.proj, ch.expert))
        assert c_order == sim_order
        assert (1, n + 0, 0, 8) in c_order and (2, n + 2, 0, 5) in c_order
        assert (3, n + 1, 0, 6) in c_order  # expert 9's stage slot, given back, staged again
        # a stage slot holding another layer's expert, or none, cannot be read
        assert cache.schedule(2, [6], [n + 2], HIGH) == sim.schedule(2, [6], [n + 2], HIGH) == -1
        assert cache.schedule(2, [7], [n + 0], HIGH) == -1
        stats = cache.stats()
        assert stats["staged"] == 5 and stats["stage_used"] == 1
        controls().cache_pause(cache.handle, False)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
def test_staged_prompt_passes_are_lossless(tiny_model: Callable[..., Path],
                                           stock: StockReference, qtype: str) -> None:
    """Prompts longer than the slots stream, and promoe copies the next layer's missing experts
    into stage slots meanwhile; tokens and logits equal stock llama.cpp's. In a Q4_K_M file the
    stage slots take the layout of most layers, and the others stage nothing."""
    model = tiny_model(qtype)
    with Llama.open(model, n_ctx=512, n_threads=2, cache=CacheConfig("offload")) as llm:
        text = text_tokens(llm, TEXT)
    prompts = [text[:n] for n in (64, 300)]
    runs = stock.run(model, prompts, 16, n_ctx=512, n_batch=N_BATCH, n_threads=2)
    cfg = CacheConfig("promoe", cache_fraction=0.25, predictor="history", stage_slots=4,
                      features=Features(split=False))
    with Llama.open(model, cache=cfg, n_ctx=512, n_batch=N_BATCH, n_threads=2) as llm:
        cache = llm.expert_cache
        assert cache is not None and cache.stage_slots() == 4
        for prompt, (ref_tokens, ref_logits) in zip(prompts, runs, strict=True):
            res = generate(llm, prompt, 16, SamplingParams(greedy=True), ignore_eos=True)
            if stock.backend != "cpu":  # the GPU check: equal up to rounding
                assert_same_tokens(res.tokens, ref_tokens, ref_logits, f"{len(prompt)} tokens")
                continue
            assert res.tokens == ref_tokens
            assert np.array_equal(last_logits(llm), ref_logits[-1])
        stats = cache.stats()
        staged = {il: cache.stats(il)["staged"] for il in range(4)}
    assert stats["streamed"] > 0 and stats["staged"] > 0 and stats["stage_used"] > 0, stats
    if qtype == "q4_k_m":  # layers 2 and 3 have Q6_K ffn_down experts: not the stage layout
        assert staged[1] > 0 and staged[2] == staged[3] == 0, staged


def test_stage_slots_rule_and_budget() -> None:
    """As many stage slots as a prompt layer misses, within 32 and a 64th of the slots."""
    assert stage_slots(64, [0, 60] + [60] * 27, streams=True) == 4  # every layer misses 4
    assert stage_slots(64, [0, 43] + [43] * 27, streams=True) == 18  # a 64th of 1204 slots
    assert stage_slots(128, [64] * 48, streams=True) == 32
    assert stage_slots(64, [64] * 4, streams=True) == 0  # every expert has a slot
    assert stage_slots(64, [0, 0], streams=True) == 0


def _prompts(n_req: int = 3, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    L, E, k, T = 8, 32, 4, 96
    out = []
    for _ in range(n_req):
        ex = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)])
                       for _ in range(T)]).astype(np.int16)
        phase = np.r_[np.zeros(64, np.int8), np.ones(T - 64, np.int8)]
        out.append(Request(experts=ex, token_ids=rng.integers(0, 100, T).astype(np.int32),
                           phase=phase))
    return out


def test_stage_slots_keep_the_bus_busy_in_simulation() -> None:
    """A prompt pass that streams: the next layer's misses copied into stage slots meanwhile
    shorten the prefill and bring it closer to its floor, within the same device memory."""
    shape = shape_of("reference", "q8_0")
    profile = replace(Profile.load("rtx4090"), dram_gbps=0.0)
    reqs = _prompts()
    runs = {}
    for stage in (0, 8):
        cfg = SimConfig("promoe", n_slots=12, n_ubatch=64, features=Features(split=False),
                        stage_slots=stage)
        runs[stage] = simulate(reqs, shape, profile, cfg, HistoryPredictor(8, 32, 4)).to_json()
    off, on = runs[0], runs[8]
    assert off["staged"] == 0 and on["stage_slots"] == 8
    assert on["staged"] > 0 and on["stage_used"] > 0
    assert on["ttft_s"] < off["ttft_s"]
    assert on["ttft_s"] / on["floor_ttft_s"] < off["ttft_s"] / off["floor_ttft_s"]


def test_stage_slots_arguments(tiny_model: Callable[[str], Path]) -> None:
    with Llama.open(tiny_model("q8_0"), n_ctx=256,
                    cache=CacheConfig("lru", slots_per_layer=2)) as llm:
        cache = llm.expert_cache
        assert cache is not None
        with pytest.raises(CacheError, match="positive"):
            cache.set_stage(0)
        assert cache.staged(0) == {} and cache.stage(0, 1, LOW) == -1
        cache.set_stage(2)
        st = cache.staged(0)
        assert st == {}
        assert cache.stage(0, 7, LOW) == 0 and cache.staged(0)[7][1] != SLOT_EMPTY


def test_gate_prefers_a_slot_over_a_stage_slot() -> None:
    """An expert staged and then loaded into a slot (a prediction) is computed from its slot; the
    layer's other misses still find slots, and the stage slot goes back."""
    from forecache.cache.prefetcher import ProMoEPolicy

    shape = shape_of("reference", "q8_0")
    n = 4
    eng = SimEngine(shape, [n] * shape.layers, Profile.load("rtx4090"), n_stage=2)
    pol = ProMoEPolicy([n] * shape.layers, Features(split=False, prefetch=False))
    pol.attach(eng)
    for s in range(n):
        eng.load(1, s, s, LOW)
    assert eng.stage(1, 9, LOW) == 0
    assert eng.load(1, 9, 3, LOW) == 0  # a prediction puts 9 into a slot too
    routed = np.array([0, 1, 9, 10, 11, 12, 13])  # more than the layer's slots: it streams
    assert pol.gate(1, routed, eng, np.ones(len(routed), np.int64))
    L = eng.layers[1]
    assert L.sch_s[L.sch_e.index(9)] == 3  # from its slot
    assert all(s < n for s in L.sch_s) and eng.staged(1) == {}
