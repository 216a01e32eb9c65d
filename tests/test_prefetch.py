"""Proactive caching on the CPU build: the copy engine's queue, promoe's losslessness, and the
simulator (determinism, agreement with the C engine, the ablation CLI)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from forecache.cache.cost import Profile
from forecache.cache.prefetcher import HIGH, LOW, SLOT_EMPTY, SLOT_QUEUED, Features
from forecache.generate import SamplingParams, generate, last_logits, text_tokens
from forecache.llama import Llama
from forecache.native.cache_api import CHUNK_EXPERT
from forecache.native.testing import ChunkInfo, controls
from forecache.placement.options import CacheConfig
from forecache.sim.engine import SimEngine
from forecache.sim.shapes import ModelShape, shape_of
from forecache.sim.simulate import SimConfig, simulate
from forecache.trace.format import Request, TraceWriter
from tests.cli_helpers import run_cli, run_cli_json
from tests.conftest import assert_same_tokens

if TYPE_CHECKING:
    from conftest import StockReference

N_BATCH = 128
TEXT = "The quick brown fox jumps over the lazy dog, again and again. " * 40


def _queued(cache, layer: int, priority: int) -> int:  # type: ignore[no-untyped-def]
    """Queued chunks of ``layer`` (-1: all) at ``priority`` (forecache-testing.h)."""
    return controls().cache_queued(cache.handle, layer, priority)


def _steps(cache) -> list[tuple[int, int, int, int, int]]:  # type: ignore[no-untyped-def]
    """Run every queued chunk on this thread: (layer, slot, proj, expert, priority) in order."""
    out, info = [], ChunkInfo()
    while controls().cache_step(cache.handle, info) == 0:
        out.append((info.layer, info.slot, info.proj, info.expert, info.priority))
    return out


def test_queue_priority_chunks_preemption_and_in_use(tiny_model: Callable[[str], Path]) -> None:
    with Llama.open(tiny_model("q8_0"), cache=CacheConfig("lru", slots_per_layer=4),
                    n_ctx=256) as llm:
        cache = llm.expert_cache
        assert cache is not None
        controls().cache_pause(cache.handle, True)
        assert cache.load(0, 4, 0, LOW) == 0 and cache.load(1, 5, 1, LOW) == 0
        assert cache.load(0, 6, 2, LOW) == 0
        assert _queued(cache, -1, LOW) == 9  # one chunk per projection by default
        info = ChunkInfo()
        assert controls().cache_step(cache.handle, info) == 0
        assert (info.layer, info.expert, info.proj, info.priority) == (0, 4, 0, LOW)
        # a miss queued now runs next: it waits for at most the one chunk that was in flight
        assert cache.load(0, 7, 3, HIGH) == 0
        assert controls().cache_step(cache.handle, info) == 0
        assert (info.layer, info.expert, info.proj, info.priority) == (0, 7, 0, HIGH)
        # early preemption of layer 0 keeping expert 6: 6 moves up, 4 goes, layer 1 is untouched
        assert cache.preempt(0, [6, 7]) == 1
        assert _queued(cache, 0, LOW) == 0 and _queued(cache, 1, LOW) == 3
        expert_of, state = cache.layer_state(0)
        assert expert_of[0] == -1 and state[0] == SLOT_EMPTY  # partly copied, then dropped
        assert expert_of[2] == 6 and state[2] == SLOT_QUEUED
        order = _steps(cache)
        assert order == [(0, 3, 1, 7, HIGH), (0, 3, 2, 7, HIGH), (0, 2, 0, 6, HIGH),
                         (0, 2, 1, 6, HIGH), (0, 2, 2, 6, HIGH), (1, 1, 0, 5, LOW),
                         (1, 1, 1, 5, LOW), (1, 1, 2, 5, LOW)]
        # the layer being computed keeps its slots: a schedule marks them in use
        assert cache.schedule(0, [6, 7], [2, 3], HIGH) == 0
        assert cache.load(0, 9, 2, LOW) == 1 and cache.load(0, 9, 1, LOW) == 0
        s = cache.stats()
        assert s["refused_loads"] == 1 and s["hi_tasks"] >= 2 and s["dropped_chunks"] == 2
        controls().cache_pause(cache.handle, False)
        cache.wait_idle()


def test_whole_expert_chunks(tiny_model: Callable[[str], Path]) -> None:
    cfg = CacheConfig("lru", slots_per_layer=2, chunk_bytes=CHUNK_EXPERT)
    with Llama.open(tiny_model("q8_0"), n_ctx=256, cache=cfg) as llm:
        cache = llm.expert_cache
        assert cache is not None
        controls().cache_pause(cache.handle, True)
        cache.load(0, 3, 0, LOW)
        info = ChunkInfo()
        assert controls().cache_step(cache.handle, info) == 0
        assert info.proj == -1 and info.size == cache.layers[0].expert_bytes
        assert controls().cache_step(cache.handle, info) == 1
        controls().cache_pause(cache.handle, False)


def _generate(model: Path, cfg: CacheConfig | None) -> list[tuple[list[int], np.ndarray, dict]]:
    with Llama.open(model, n_ctx=512, n_batch=N_BATCH, n_threads=2, cache=cfg) as llm:
        text = text_tokens(llm, TEXT)
        out = []
        for n in (1, 64, 300):
            res = generate(llm, text[:n], 32, SamplingParams(greedy=True), ignore_eos=True)
            stats = dict(res.stats, **(llm.expert_cache.stats() if llm.expert_cache else {}))
            out.append((res.tokens, last_logits(llm), stats))
        return out


def _slow_bus(tmp_path: Path) -> str:
    """A machine profile with copies slower than the host's (memory-bound) expert compute: missing
    experts go to the CPU while resident ones stay on the device, in the same layers."""
    raw = json.loads(resources.files("forecache").joinpath(
        "data/profiles/rtx4090.json").read_text())
    path = tmp_path / "slow-bus.json"
    path.write_text(json.dumps(dict(raw, name="slow-bus", h2d_gbps=0.01, cpu_mem_gbps=0.1)))
    return str(path)


@pytest.mark.parametrize("features", [Features(), Features(split=False),
                                      Features(reorder=False, split=False), Features(chunk=False),
                                      Features(preempt=False), Features(prefetch=False)],
                         ids=lambda f: f.label())
@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3moe", "tiny-mixtral", "tiny-olmoe",
                                    "tiny-granitemoe", "tiny-deepseek2", "tiny-gpt-oss",
                                    "tiny-lfm2moe"])
def test_promoe_is_lossless(preset: str, tiny_model: Callable[..., Path], features: Features,
                            tmp_path: Path, stock: StockReference) -> None:
    """Every switch of promoe on every architecture, equal to the unpatched build; with all of
    them on, against a slow bus, layers split between slots and host experts."""
    model = tiny_model("q8_0", preset)
    with Llama.open(model, n_ctx=512, n_threads=2, cache=CacheConfig("offload")) as llm:
        text = text_tokens(llm, TEXT)
    runs = stock.run(model, [text[:n] for n in (1, 64, 300)], 32, n_ctx=512, n_batch=N_BATCH,
                     n_threads=2)
    ref = [(tokens, logits[-1], {}) for tokens, logits in runs]
    for frac in (0.25, 0.5):
        # all-default features: split against a slow bus, so layers mix slots and CPU experts
        machine = _slow_bus(tmp_path) if features == Features() else "rtx4090"
        cfg = CacheConfig("promoe", cache_fraction=frac, features=features, predictor="history",
                          machine=machine)
        got = _generate(model, cfg)
        for (t, lg, _), (rt, rlg, _), (_, steps) in zip(got, ref, runs, strict=True):
            if stock.backend != "cpu":  # the GPU check: equal up to rounding
                assert_same_tokens(t, rt, steps, f"{features.label()} {frac}")
                continue
            assert t == rt, (preset, features.label(), frac)
            assert np.array_equal(lg, rlg), (preset, features.label(), frac)
        total = {k: sum(g[2][k] for g in got)
                 for k in ("streamed", "host_layers", "h2d_bytes", "host_entries", "hits")}
        assert total["h2d_bytes"] > 0
        for g in got:  # a miss waits behind at most the one lower-priority chunk in flight
            assert g[2]["hi_block_max_s"] <= g[2]["chunk_max_s"]
        if features == Features():
            assert total["host_entries"] > 0 and total["hits"] > 0, total
        elif not features.split:
            assert total["host_entries"] == 0
            if features.reorder:  # ubatches with more experts than slots stream through them
                assert total["streamed"] > 0 and total["host_layers"] == 0
            else:
                assert total["streamed"] == 0 and total["host_layers"] > 0


def _requests(n_req: int = 6, seed: int = 0) -> list[Request]:
    """Routing with locality: each token keeps half of its previous experts."""
    rng = np.random.default_rng(seed)
    L, E, k = 8, 32, 4
    out = []
    for _ in range(n_req):
        T = 40
        ex = np.zeros((T, L, k), np.int16)
        for t in range(T):
            for il in range(L):
                keep = ex[t - 1, il, :2] if t else rng.choice(E, 2, replace=False)
                rest = rng.choice(np.setdiff1d(np.arange(E), keep), k - 2, replace=False)
                ex[t, il] = np.r_[keep, rest]
        phase = np.r_[np.zeros(24, np.int8), np.ones(T - 24, np.int8)]
        out.append(Request(experts=ex, token_ids=rng.integers(0, 100, T).astype(np.int32),
                           phase=phase))
    return out


def test_simulator_is_deterministic_and_streams_prefill(tmp_path: Path) -> None:
    from dataclasses import replace

    from forecache.predictor.history import HistoryPredictor

    # the mechanism on ProMoE's bare machine: no runtime costs or shared DRAM to hide it
    shape = shape_of("reference", "q8_0")
    profile = replace(Profile.load("rtx4090"), hook_s=5e-5, prefetch_hook_s=0.0, token_s=0.0,
                      group_s=0.0, dram_gbps=0.0)
    reqs = _requests()
    runs = {}
    for name, cfg in (("lru", SimConfig("lru", n_slots=12, n_ubatch=8)),
                      ("promoe", SimConfig("promoe", n_slots=12, n_ubatch=8,
                                           features=Features(split=False))),
                      ("split", SimConfig("promoe", n_slots=12, n_ubatch=8))):
        a = simulate(reqs, shape, profile, cfg, HistoryPredictor(8, 32, 4)).to_json()
        b = simulate(reqs, shape, profile, cfg, HistoryPredictor(8, 32, 4)).to_json()
        assert a == b
        runs[name] = a
    assert runs["lru"]["host_layers"] > 0 and runs["promoe"]["host_layers"] == 0
    assert runs["promoe"]["streamed"] > 0
    assert runs["promoe"]["prefetch_loads"] > 0
    # a miss waits for at most the one lower-priority chunk copying when it was queued
    chunk_s = profile.chunk_latency_s + max(shape.proj_bytes) / (profile.h2d_gbps * 1e9)
    assert 0 < runs["promoe"]["hi_block_max_s"] <= chunk_s + 1e-12
    # the split computes misses on the CPU where that is cheaper than streaming them
    assert runs["promoe"]["host_entries"] == 0
    assert runs["split"]["host_entries"] + runs["split"]["host_layers"] > 0
    assert runs["split"]["prefill_s"] < runs["promoe"]["prefill_s"]
    # with copies dearer than the host's compute, layers mix slots and host entries
    slow = Profile.load(_slow_bus(tmp_path))
    mixed = simulate(reqs, shape, slow, SimConfig("promoe", n_slots=12, n_ubatch=8),
                     HistoryPredictor(8, 32, 4)).to_json()
    assert mixed["host_entries"] > 0 and mixed["hits"] > 0


def test_sim_engine_follows_the_c_engine(tiny_model: Callable[[str], Path]) -> None:
    """The same loads, preemption and schedule give the same slot states and copy order."""
    from forecache.gguf.header import read_model_file

    model = tiny_model("q8_0")
    mf = read_model_file(model)
    with Llama.open(model, n_ctx=256, cache=CacheConfig("lru", slots_per_layer=4)) as llm:
        cache = llm.expert_cache
        assert cache is not None
        nb = cache.layers[0].expert_bytes
        shape = shape_of("tiny", "q8_0")
        assert shape.experts == mf.n_expert
        sim = SimEngine(shape, [4] * mf.n_layer, Profile.load("rtx4090"))
        sim.paused = True
        controls().cache_pause(cache.handle, True)
        script = [("load", 0, 4, 0, LOW), ("load", 0, 5, 1, LOW), ("load", 1, 6, 0, LOW),
                  ("load", 0, 7, 2, HIGH), ("preempt", 0, [5, 7]),
                  ("schedule", 0, [5, 7, 9, 10, 11], [1, 2, 0, 3, 0]),
                  ("load", 0, 12, 3, LOW), ("load", 1, 13, 3, LOW)]
        for op in script:
            if op[0] == "load":
                assert cache.load(*op[1:]) == sim.load(*op[1:])
            elif op[0] == "preempt":
                assert cache.preempt(op[1], op[2]) == sim.preempt(op[1], op[2])
            else:
                assert cache.schedule(op[1], op[2], op[3], HIGH) == \
                    sim.schedule(op[1], op[2], op[3], HIGH)
            for il in (0, 1):
                c, s = cache.layer_state(il), sim.layer_state(il)
                assert np.array_equal(c[0], s[0]) and np.array_equal(c[1], s[1]), (op, il)
        c_order = [(lay, slot, proj, e) for lay, slot, proj, e, _ in _steps(cache)]
        sim_order = []
        while (ch := sim._pop()) is not None:
            sim_order.append((ch.layer, ch.slot, ch.proj, ch.expert))
        # streamed copies wait for their slot's previous expert: neither engine can run them yet
        assert c_order == sim_order and len(c_order) > 0
        assert _queued(cache, 0, HIGH) == sum(len(q) for q in sim.queue[:1]) > 0
        assert nb == shape.expert_bytes
        controls().cache_pause(cache.handle, False)


def test_simulate_cli(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    with TraceWriter(path, n_layers=8, top_k=4) as w:
        for r in _requests(4, seed=1):
            w.add_request(r.experts, token_ids=r.token_ids, phase=r.phase)
    out = run_cli_json("simulate", "--trace", str(path), "--shape", "reference", "--qtype",
                       "q8_0", "--cache-fraction", "0.4", "--predictor", "history",
                       "--n-ubatch", "8", "--ablation")
    labels = [r["run"] for r in out["runs"]]
    assert labels == ["base (lru)", "+prefetch", "+chunked", "+early preemption", "+reordered",
                      "+host split", "static"]
    assert out["n_slots"] == 13 and out["replay_requests"] == 2
    for r in out["runs"]:
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0 and len(r["per_layer"]) == 8
    again = run_cli_json("simulate", "--trace", str(path), "--shape", "reference", "--qtype",
                         "q8_0", "--cache-fraction", "0.4", "--predictor", "history",
                         "--n-ubatch", "8", "--ablation")
    assert json.dumps(again, sort_keys=True) == json.dumps(out, sort_keys=True)
    bad = run_cli("simulate", "--trace", str(path), "--shape", "qwen2-57b-a14b",
                  "--cache-fraction", "0.5")
    assert bad.returncode != 0 and "--shape must agree" in bad.stderr
    # --compare: stock llama.cpp's best first, and every policy on the same budget
    cmp = run_cli_json("simulate", "--trace", str(path), "--shape", "reference", "--qtype",
                       "q8_0", "--cache-fraction", "0.4", "--predictor", "history", "--compare")
    runs = {r["run"]: r for r in cmp["runs"]}
    assert list(runs) == ["ncmoe", "ncmoe-mmap", "offload", "lru", "lfu", "static", "promoe",
                          "infinity"]
    assert runs["ncmoe"]["hits"] > 0 and runs["offload"]["hits"] == 0
    # prompts of 24 tokens run on the CPU (below llama.cpp's op offload): mmap'd host experts
    # change nothing, and ncmoe is stock's best in every figure
    assert runs["ncmoe-mmap"]["ttft_s"] == runs["ncmoe"]["ttft_s"]
    assert cmp["ncmoe_best"]["ttft_from"] == cmp["ncmoe_best"]["tpot_from"] == "ncmoe"
    text = run_cli("simulate", "--trace", str(path), "--shape", "reference", "--qtype", "q8_0",
                   "--cache-fraction", "0.4", "--predictor", "history", "--compare",
                   check=True).stdout
    assert "ratios to ncmoe" in text and text.splitlines()[2].split()[-3:] == ["1.00x"] * 2 + ["-"]


def _engine(n_slots: int = 4) -> SimEngine:
    eng = SimEngine(shape_of("reference", "q8_0"), [n_slots] * 8, Profile.load("rtx4090"))
    eng.paused = True  # copies start only when a test says so
    return eng


def test_gate_orders_cache_first_and_keeps_needed_experts() -> None:
    from forecache.cache.prefetcher import SLOT_COPYING, SLOT_READY, ProMoEPolicy

    eng = _engine()
    pol = ProMoEPolicy([4] * 8, Features(split=False))
    for e, s in ((1, 0), (2, 1), (3, 2)):
        assert eng.load(0, e, s, LOW) == 0
    eng.paused = False
    eng._kick()
    eng.wait_until(lambda: eng.layer_state(0)[1][0] == SLOT_READY)  # expert 1 copied
    eng.paused = True  # expert 2 is being copied, 3 is still queued
    eng.advance_to(eng.busy_until - 1e-9)
    assert eng.layer_state(0)[1].tolist()[:3] == [SLOT_READY, SLOT_COPYING, SLOT_QUEUED]
    assert pol.gate(0, np.array([7, 3, 2, 1]), eng)
    L = eng.layers[0]
    assert L.sch_e == [1, 2, 3, 7]  # ready, in flight, queued, missing
    assert L.sch_s[:3] == [0, 1, 2] and L.sch_s[3] == 3  # the free slot, nothing evicted
    # a prediction for the layer being computed cannot take its slots
    assert eng.load(0, 9, 0, LOW) == 1
    # a later pass that needs fewer experts evicts only ones it does not need
    eng.paused = False
    eng.wait_until(lambda: eng.running is None and not any(eng.queue))
    assert pol.gate(1, np.array([5]), eng)  # the next layer frees layer 0's slots
    assert pol.gate(0, np.array([1, 11]), eng)
    expert_of = eng.layer_state(0)[0].tolist()
    assert 1 in expert_of and 11 in expert_of
    assert expert_of.index(11) != expert_of.index(1)


def test_split_plan_by_cost() -> None:
    from forecache.cache.cost import CostModel, ExpertShape

    shape = ExpertShape(1024, 704, (405504, 405504, 765952))
    prof = Profile.load("rtx4090")
    cost = CostModel.from_profile(prof, shape)
    # decode, every expert resident: the device computes them
    assert cost.choose_split([(1, 1, True), (2, 1, True)], 0).host == []
    assert not cost.choose_split([(1, 1, True), (2, 1, True)], 0).whole_layer
    # decode, one small miss: copying it is quicker than the host's launches and the merge
    assert cost.choose_split([(1, 1, True), (2, 1, False)], 0).host == []
    # decode, one Mixtral-sized miss: reading its weights on the host beats copying them
    proj = 4096 * 14336 // 256 * 144  # q4_k
    mixtral = CostModel.from_profile(prof, ExpertShape(4096, 14336, (proj, proj, proj)))
    plan = mixtral.choose_split([(1, 1, True), (2, 1, False)], 0)
    assert plan.host == [2] and not plan.whole_layer
    # a 512-token ubatch over every expert: the CPU would need far longer than the copies
    rows = [(e, 48, e < 36) for e in range(64)]
    big = cost.choose_split(rows, 0)
    assert not big.whole_layer and len(big.host) < 28
    # the few-token misses are the ones that go to the host
    rows = [(e, 1 if e in (40, 41) else 60, e < 36) for e in range(64)]
    assert {40, 41} <= set(cost.choose_split(rows, 0).host)
    # a CPU far faster than the bus and the device takes the whole layer
    fast = replace(prof, cpu_gflops=1e9, cpu_mem_gbps=1e9, cpu_launch_s=0.0, h2d_gbps=0.01,
                   gpu_launch_s=1.0)
    fast_cost = CostModel.from_profile(fast, shape)
    assert fast_cost.choose_split([(1, 4, False), (2, 4, True)], 0).whole_layer
    # measured rates correct the profile
    per_copy = shape.nbytes / 5e9 + 3 * prof.chunk_latency_s  # 5 GB/s plus three chunks
    cost.calibrate(h2d_bytes=shape.nbytes * 100, copy_s=100 * per_copy, host_s=0.0)
    assert abs(cost.copy_gbps - 5.0) / 5.0 < 0.05
    # a device computing more slowly than its profile says (an RPC server: another machine's
    # processor, a round trip a group): its groups' time scales the device side, and a miss
    # the profile's device would compute then goes to the host
    one = cost.dev_s(1, 1)
    cost.calibrate(0, 0.0, 0.0, group_s=0.05, group_entries=3 * 100, group_rows=3 * 100)
    assert cost.dev_scale == 1.0  # only a device that asks for it (calibrate_device)
    slow = replace(mixtral, calibrate_device=True)
    rows = [(e, 1, e != 7) for e in range(8)]
    assert slow.choose_split(rows, 0).host == [7]
    slow.calibrate(0, 0.0, 0.0, group_s=100 * 50 * slow.dev_s(1, 1), group_entries=3 * 100,
                   group_rows=3 * 100)
    assert slow.dev_scale == pytest.approx(50.0) and cost.dev_s(1, 1) == one
    assert slow.dev_s(1, 1) == pytest.approx(50 * mixtral.dev_s(1, 1))
    assert slow.choose_split(rows, 0).whole_layer or len(slow.choose_split(rows, 0).host) > 1


def test_stock_policies_follow_llama_cpp_rules() -> None:
    """offload and ncmoe as stock llama.cpp runs them: host experts are copied up (only those a
    ubatch uses) for ubatches of 32 tokens or more and computed on the CPU below that; ncmoe
    keeps the first layers' experts on the host and as many whole layers as fit on the device."""
    from dataclasses import replace

    shape, profile = shape_of("reference", "q8_0"), Profile.load("rtx4090")
    rng = np.random.default_rng(1)
    L, E, k, T, P = 8, 32, 4, 72, 64
    ex = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)])
                   for _ in range(T)]).astype(np.int16)
    req = Request(experts=ex, phase=np.r_[np.zeros(P, np.int8), np.ones(T - P, np.int8)])
    used = sum(len(np.unique(ex[:P, il])) for il in range(L))  # expert copies of one prefill

    decode_misses = sum(len(set(ex[t, il])) for t in range(P, T) for il in range(L))
    big = simulate([req], shape, profile, SimConfig("offload", 0, n_ubatch=P)).to_json()
    assert big["h2d_bytes"] == used * shape.expert_bytes  # decode tokens copy nothing
    assert big["misses"] == used + decode_misses
    small = simulate([req], shape, profile, SimConfig("offload", 0, n_ubatch=16)).to_json()
    assert small["h2d_bytes"] == 0 and small["decode_s"] == pytest.approx(big["decode_s"])
    cpu = replace(profile, op_offload_min_batch=0)  # a CPU build never copies
    assert simulate([req], shape, cpu, SimConfig("offload", 0, n_ubatch=P)).h2d_bytes == 0

    # 12 slots of 32 experts over 8 layers: 96 experts, three whole layers on the device
    nc = simulate([req], shape, profile, SimConfig("ncmoe", n_slots=12, n_ubatch=P)).to_json()
    on_gpu = sum(len(np.unique(ex[:P, il])) + sum(len(set(ex[t, il])) for t in range(P, T))
                 for il in (5, 6, 7))
    assert nc["hits"] == on_gpu and nc["misses"] == big["misses"] - on_gpu
    assert nc["h2d_bytes"] == sum(len(np.unique(ex[:P, il])) for il in range(5)) * \
        shape.expert_bytes
    assert nc["ttft_s"] < big["ttft_s"] and nc["tpot_s"] < big["tpot_s"]
    full = simulate([req], shape, profile, SimConfig("ncmoe", n_slots=E, n_ubatch=P)).to_json()
    assert full["misses"] == 0 and full["h2d_bytes"] == 0 and full["stall_s"] == 0
    # every run lies above its physical floor; with nothing missed, only the per-pass cost
    # separates them
    for run in (big, small, nc, full):
        assert 0 < run["floor_ttft_s"] <= run["ttft_s"] and 0 < run["floor_tpot_s"] <= run["tpot_s"]
    assert full["tpot_s"] - full["floor_tpot_s"] == pytest.approx(profile.token_s)


def _prompts(shape: ModelShape, n_req: int, prompt: int, answer: int, seed: int) -> list[Request]:
    """Uniformly random routing at ``shape``: ``n_req`` requests of ``prompt`` + ``answer`` rows."""
    rng = np.random.default_rng(seed)
    L, E, k = shape.layers, shape.experts, shape.top_k
    out = []
    for _ in range(n_req):
        ex = np.argsort(rng.random((prompt + answer, L, E)), axis=2)[:, :, :k].astype(np.int16)
        out.append(Request(experts=ex, phase=np.r_[np.zeros(prompt, np.int8),
                                                     np.ones(answer, np.int8)]))
    return out


def test_ncmoe_mmap_copies_host_experts_at_the_pageable_rate(tmp_path: Path) -> None:
    """Stock --n-cpu-moe with its host experts mmap'd (llama.cpp's default: pageable memory)
    copies a prompt's host experts up slower than with --no-mmap (pinned) by the bandwidth
    ratio; decode computes the host layers on the CPU either way, in the same time."""
    from forecache.cache.cost import PAGEABLE_SHARE
    from forecache.sim.run import slots_for, stock_best

    profile = Profile.load("rtx4090")
    # the shipped profile gives no pageable rate: a share of the pinned one stands for it
    assert profile.h2d_pageable_gbps == 0
    assert profile.pageable_gbps() == pytest.approx(PAGEABLE_SHARE * profile.h2d_gbps)
    assert 0 < PAGEABLE_SHARE < 1
    # the target: Qwen2-57B-A14B q4_k at 24 GiB, prompts of 512 tokens (a prefill-heavy job)
    shape = shape_of("qwen2-57b-a14b", "q4_k")
    cfg = SimConfig("ncmoe", slots_for(shape, shape.layers, "24GiB", None), n_ubatch=512)
    reqs = _prompts(shape, 2, 512, 4, seed=2)
    pin = simulate(reqs, shape, profile, cfg)
    mm = simulate(reqs, shape, profile, replace(cfg, policy="ncmoe-mmap"))
    # the same host experts cross the bus, from memory of another kind
    assert mm.h2d_bytes == pin.h2d_bytes > 0
    assert (mm.hits, mm.misses, mm.host_layers) == (pin.hits, pin.misses, pin.host_layers)
    slower = pin.h2d_bytes * (1 / profile.pageable_gbps() - 1 / profile.h2d_gbps) / 1e9
    assert mm.stall_s - pin.stall_s == pytest.approx(slower)
    assert mm.ttft_s - pin.ttft_s == pytest.approx(slower / len(reqs))
    # the copies take the bandwidth ratio longer (each copy's fixed latency aside), and they
    # are most of a prompt's time: TTFT grows by most of that ratio (the H200 host measured
    # 341 ms against 1067 ms)
    ratio = profile.h2d_gbps / profile.pageable_gbps()
    assert mm.stall_s / pin.stall_s == pytest.approx(ratio, rel=0.01)
    assert 0.6 * ratio < mm.ttft_s / pin.ttft_s < ratio
    # decode: 1-token ubatches compute the host layers on the CPU, with no copies
    assert mm.n_decode_tokens == pin.n_decode_tokens > 0
    assert mm.tpot_s == pytest.approx(pin.tpot_s, rel=1e-9)
    assert mm.decode_s == pytest.approx(pin.decode_s, rel=1e-9)
    # stock's best: pinned prefills faster; decode is a tie, which names the pinned run
    best = stock_best({"ncmoe": pin, "ncmoe-mmap": mm})
    assert best.of("ttft_s") == ("ncmoe", pin.ttft_s) and best.of("tpot_s")[0] == "ncmoe"
    # a profile's own pageable rate is used where it gives one, from JSON too
    raw = json.loads(resources.files("forecache").joinpath(
        "data/profiles/rtx4090.json").read_text())
    path = tmp_path / "half.json"
    path.write_text(json.dumps({**raw, "h2d_pageable_gbps": raw["h2d_gbps"] / 2}))
    half = Profile.load(str(path))
    assert half.pageable_gbps() == raw["h2d_gbps"] / 2
    hm = simulate(reqs, shape, half, replace(cfg, policy="ncmoe-mmap"))
    assert hm.stall_s / pin.stall_s == pytest.approx(2.0, rel=0.01)
    assert simulate(reqs, shape, half, cfg).ttft_s == pytest.approx(pin.ttft_s)
    # a CPU build never copies: both are the same run
    cpu = replace(profile, op_offload_min_batch=0)
    a, b = (simulate(reqs, shape, cpu, replace(cfg, policy=p)) for p in ("ncmoe", "ncmoe-mmap"))
    assert (a.ttft_s, a.tpot_s, a.h2d_bytes) == pytest.approx((b.ttft_s, b.tpot_s, b.h2d_bytes))


def test_ratios_over_ncmoe_take_the_faster_run(tmp_path: Path) -> None:
    """A speedup over ncmoe is over stock llama.cpp's faster run in that figure, pinned or
    mmap'd: TTFT and TPOT each from the run that is faster in it."""
    from forecache.sim.run import StockBest, stock_best

    shape, profile = shape_of("reference", "q8_0"), Profile.load("rtx4090")
    reqs = _prompts(shape, 2, 64, 6, seed=4)
    cfg = SimConfig("ncmoe", 12, n_ubatch=64)
    pin = simulate(reqs, shape, profile, cfg)
    # as if mmap'd weights prefilled faster but decoded slower: each figure from its faster run
    mm = replace(pin, ttft_s=pin.ttft_s / 2, tpot_s=pin.tpot_s * 2, stall_s=0.0)
    best = stock_best({"lru": pin, "ncmoe": pin, "ncmoe-mmap": mm})
    assert isinstance(best, StockBest) and set(best.runs) == {"ncmoe", "ncmoe-mmap"}
    assert (best.ttft_s, best.tpot_s, best.stall_s) == (mm.ttft_s, pin.tpot_s, 0.0)
    assert best.of("ttft_s")[0] == "ncmoe-mmap" and best.of("tpot_s")[0] == "ncmoe"
    got = best.to_json()
    assert (got["ttft_from"], got["tpot_from"]) == ("ncmoe-mmap", "ncmoe")
    with pytest.raises(ValueError, match="no ncmoe run"):
        stock_best({"lru": pin})

    # the simulator's table: on a machine whose pageable copies were the faster (a profile
    # saying so), prefill ratios are over ncmoe-mmap's TTFT, decode ratios over the shared TPOT
    trace = tmp_path / "t.npz"
    with TraceWriter(trace, n_layers=8, top_k=4) as w:
        for r in _prompts(shape, 4, 64, 6, seed=5):
            w.add_request(r.experts, token_ids=np.arange(r.n_tokens, dtype=np.int32) % 100,
                          phase=r.phase)
    raw = json.loads(resources.files("forecache").joinpath(
        "data/profiles/rtx4090.json").read_text())
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps({**raw, "h2d_pageable_gbps": 4 * raw["h2d_gbps"]}))
    args = ("simulate", "--trace", str(trace), "--shape", "reference", "--qtype", "q8_0",
            "--cache-fraction", "0.4", "--predictor", "history", "--n-ubatch", "64",
            "--profile", str(fast), "--compare")
    out = run_cli_json(*args)
    runs = {r["run"]: r for r in out["runs"]}
    assert list(runs)[:3] == ["ncmoe", "ncmoe-mmap", "offload"]
    nc, nm = runs["ncmoe"], runs["ncmoe-mmap"]
    assert nm["ttft_s"] < nc["ttft_s"] and nm["tpot_s"] == pytest.approx(nc["tpot_s"])
    assert out["ncmoe_best"]["ttft_s"] == nm["ttft_s"]
    assert out["ncmoe_best"]["ttft_from"] == "ncmoe-mmap"
    assert out["ncmoe_best"]["tpot_s"] == min(nc["tpot_s"], nm["tpot_s"])
    lines = run_cli(*args, check=True).stdout.splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines[2:2 + len(runs)]}
    # run, TTFT, TPOT, hit, H2D, stall, then the prefill, decode and stall-cut ratios
    assert rows["ncmoe-mmap"][6:8] == ["1.00x", "1.00x"]
    assert rows["ncmoe"][6] == f"{nm['ttft_s'] / nc['ttft_s']:.2f}x" != "1.00x"
    lru = runs["lru"]
    assert rows["lru"][6:8] == [f"{nm['ttft_s'] / lru['ttft_s']:.2f}x",
                                f"{min(nc['tpot_s'], nm['tpot_s']) / lru['tpot_s']:.2f}x"]
    assert "ratios to ncmoe, the faster of ncmoe" in lines[-1]


def test_copies_and_cpu_compute_share_dram() -> None:
    """With a DRAM bandwidth below what copies and CPU expert compute ask for together, runs
    that overlap them (promoe's host split) slow down; runs that never overlap them do not."""
    from dataclasses import replace

    from forecache.predictor.history import HistoryPredictor

    shape, free = shape_of("reference", "q8_0"), Profile.load("rtx4090")
    free = replace(free, dram_gbps=0.0)
    tight = replace(free, dram_gbps=0.5 * (free.h2d_gbps + free.cpu_mem_gbps))
    assert tight.shared_dram_factor() == 0.5 and free.shared_dram_factor() == 1.0
    reqs = _requests()
    cfg = SimConfig("promoe", n_slots=6, n_ubatch=8)
    a = simulate(reqs, shape, free, cfg, HistoryPredictor(8, 32, 4))
    b = simulate(reqs, shape, tight, cfg, HistoryPredictor(8, 32, 4))
    assert a.extra["host_entries"] + a.host_layers > 0  # the CPU computes beside the copies
    assert b.decode_s > a.decode_s
    for pol in ("ncmoe", "offload"):  # copies and CPU compute take turns
        x = simulate(reqs, shape, free, SimConfig(pol, n_slots=6, n_ubatch=64))
        y = simulate(reqs, shape, tight, SimConfig(pol, n_slots=6, n_ubatch=64))
        assert (x.prefill_s, x.decode_s) == (y.prefill_s, y.decode_s)


def test_host_entries_pay_for_their_thread() -> None:
    """Each projection with host entries starts a CPU thread (forecache-cache.cpp
    fc_slot_compute): the cost model plans with it and the simulator charges it."""
    from dataclasses import replace

    from forecache.cache.cost import CostModel
    from forecache.predictor.history import HistoryPredictor

    shape = shape_of("reference", "q8_0")
    # copies dearer than the host's compute: layers mix slots and host entries
    base = replace(Profile.load("rtx4090"), h2d_gbps=0.01, cpu_mem_gbps=0.1, dram_gbps=0.0,
                   thread_s=0.0)
    slow = replace(base, thread_s=1e-3)
    a, b = CostModel.from_profile(base, shape.expert), CostModel.from_profile(slow, shape.expert)
    assert b.merge_proj_s(4) - a.merge_proj_s(4) == pytest.approx(1e-3)
    cfg = SimConfig("promoe", n_slots=12, n_ubatch=8)
    x = simulate(_requests(), shape, base, cfg, HistoryPredictor(8, 32, 4))
    y = simulate(_requests(), shape, slow, cfg, HistoryPredictor(8, 32, 4))
    assert x.extra["host_entries"] > 0
    # dearer host entries: the plan sends fewer experts to the CPU, and the run is slower
    assert y.extra["host_entries"] < x.extra["host_entries"]
    assert y.decode_s + y.prefill_s > x.decode_s + x.prefill_s


def test_unlogged_layers_are_left_out() -> None:
    """A trace that logged some MoE layers only is simulated as the model of those layers: the
    same times as the logged layers replayed at a shape of that depth, for every policy."""
    from forecache.trace import synth

    sh = shape_of("granite-3.0-1b-a400m", "q4_k")
    reqs = synth.synthesize(synth.SynthParams(), n_layers=sh.layers, n_expert=sh.experts,
                            top_k=sh.top_k, tokens=[40, 24], prefill=[36, 0], seed=3)
    logged = list(range(0, sh.layers, 3))
    partial = []
    for r in reqs:
        ex = np.full_like(r.experts, -1)
        ex[:, logged] = r.experts[:, logged]
        partial.append(replace(r, experts=ex))
    compact = [replace(r, experts=r.experts[:, logged]) for r in reqs]
    small = replace(sh, layers=len(logged))
    for policy in ("ncmoe", "lru", "promoe"):
        cfg = SimConfig(policy, 18, n_ubatch=32)
        a = simulate(partial, sh, Profile.load("rtx4090"), cfg)
        b = simulate(compact, small, Profile.load("rtx4090"), cfg)
        assert a.extra["layers_simulated"] == len(logged)
        assert (a.ttft_s, a.tpot_s, a.hits, a.misses) == pytest.approx(
            (b.ttft_s, b.tpot_s, b.hits, b.misses)), policy


def test_shared_dram_overlap() -> None:
    """Copies and CPU compute that start together, each at half its rate while both run: the
    shorter ends at twice its time, the longer as much later as the shorter took alone."""
    from forecache.cache.cost import shared_dram

    assert shared_dram(1.0, 0.5, 0.5) == (1.5, 1.0)
    assert shared_dram(0.5, 1.0, 0.5) == (1.0, 1.5)
    assert shared_dram(2.0, 0.0, 0.5) == (2.0, 0.0)  # nothing shared
    assert shared_dram(1.0, 1.0, 1.0) == (1.0, 1.0)  # DRAM not modelled
    assert shared_dram(1.0, 1.0, 0.88) == pytest.approx((1 / 0.88, 1 / 0.88))


def test_layer_on_the_cpu_still_warms_the_cache() -> None:
    """A cold layer computed wholly on the CPU queues as many of its missing experts as copy
    while the CPU computes it, so later tokens find them in slots; no more than that."""
    from forecache.cache.cost import CostModel, ExpertShape
    from forecache.cache.prefetcher import ProMoEPolicy

    eng = _engine(8)
    proj = 2048 * 1024 // 256 * 144  # OLMoE-sized q4_k experts: the CPU beats copying
    cost = CostModel.from_profile(Profile.load("rtx4090"), ExpertShape(2048, 1024, (proj,) * 3))
    pol = ProMoEPolicy([8] * 8, Features(), cost)
    routed = np.arange(1, 9)
    rows = [(e, 1, False) for e in routed.tolist()]
    assert cost.best_split(rows, 0)[0].whole_layer
    hidden = int(cost.host_s(8, 8) // cost.copy_s())
    assert 0 < hidden < 8
    assert not pol.gate(0, routed, eng, np.ones(8, np.int64))  # computed from host memory
    expert_of = eng.layer_state(0)[0].tolist()
    assert sorted(e for e in expert_of if e >= 0) == routed.tolist()[:hidden]


def test_a_prompt_sized_ubatch_computes_every_expert_on_the_device() -> None:
    """The host split is for small ubatches: one of DEVICE_MIN_TOKENS tokens or more copies its
    missing experts and computes them all on the device, as llama.cpp's op offload does, even
    where the cost model would send the layer to the CPU; ``prompt_split`` keeps the old rule."""
    from forecache.cache.cost import DEVICE_MIN_TOKENS, CostModel, ExpertShape
    from forecache.cache.prefetcher import ProMoEPolicy

    proj = 2048 * 1024 // 256 * 144  # OLMoE-sized q4_k experts: the CPU beats copying
    cost = CostModel.from_profile(Profile.load("rtx4090"), ExpertShape(2048, 1024, (proj,) * 3))
    routed = np.arange(1, 9)
    counts = np.full(8, 2, np.int64)
    assert cost.best_split([(e, 2, False) for e in routed.tolist()], 0)[0].whole_layer
    for tokens, feats, on_slots in ((DEVICE_MIN_TOKENS - 1, Features(), False),
                                    (DEVICE_MIN_TOKENS, Features(), True),
                                    (DEVICE_MIN_TOKENS, Features(prompt_split=True), False)):
        eng = _engine(8)
        pol = ProMoEPolicy([8] * 8, feats, cost)
        assert pol.gate(0, routed, eng, counts, tokens) is on_slots, (tokens, feats)
        if on_slots:  # every routed expert has a slot in the schedule, none is the host's
            L = eng.layers[0]
            assert sorted(L.sch_e) == routed.tolist() and min(L.sch_s) >= 0
