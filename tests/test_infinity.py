"""MoE-Infinity's activation-aware cache (``infinity``), the ``lfu`` baseline, slots sized from
measured reuse, and the EAM predictor at run time: constructed routing for the orders, the CPU
build for losslessness, the command line for the stored collection."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from cli_helpers import run_cli

from forecache.cache.allocation import allocate_slots, reallocate
from forecache.cache.cost import Profile
from forecache.cache.infinity import InfinityPolicy
from forecache.cache.policies import LFUPolicy, LRUPolicy
from forecache.cache.prefetcher import Features
from forecache.generate import SamplingParams, generate, last_logits, text_tokens
from forecache.llama import Llama
from forecache.models.default import REFERENCE_MODEL
from forecache.placement.options import CacheConfig
from forecache.predictor.history import HistoryPredictor
from forecache.sim.engine import SimEngine
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig, Simulator, simulate
from forecache.trace.format import Request
from forecache.trace.stats import lru_hit_curves

if TYPE_CHECKING:
    from conftest import StockReference

N_BATCH = 128
TEXT = "The quick brown fox jumps over the lazy dog, again and again. " * 40


# -- slots from measured reuse -----------------------------------------------------------------
def _cycling(n_tok: int, periods: list[int | None], n_expert: int, seed: int = 0) -> np.ndarray:
    """Top-1 routing [T, L, 1]: layer l cycles through ``periods[l]`` experts (None: uniform)."""
    rng = np.random.default_rng(seed)
    ex = np.zeros((n_tok, len(periods), 1), np.int16)
    for il, p in enumerate(periods):
        ex[:, il, 0] = rng.integers(0, n_expert, n_tok) if p is None else np.arange(n_tok) % p
    return ex


def test_hit_curves_follow_lru_and_need_whole_rows() -> None:
    # layer 0 alternates two experts: one slot never hits (each evicts the other), two always do
    curves = lru_hit_curves([_cycling(10, [2], 8)], 8)
    assert curves[0].tolist() == [0, 0] + [8] * 7
    # top-2 rows: a cache of one slot cannot hold a row, so it hits nothing
    ex = np.array([[[0, 1]], [[0, 1]], [[1, 2]]], np.int16)
    assert lru_hit_curves([ex], 4)[0].tolist() == [0, 0, 3, 3, 3]
    # counted rows: only decode rows are looked up, every row updates recency
    mask = np.array([False, False, True])
    assert lru_hit_curves([ex], 4, [mask])[0].tolist() == [0, 0, 1, 1, 1]


def test_allocation_gives_slots_where_reuse_pays() -> None:
    # layer 0 needs 2 slots, layer 1 needs 6 (a cycle of 6 hits only when all 6 fit), layer 2 is
    # uniform over 8 experts (each slot saves about 1/8 of its lookups)
    curves = lru_hit_curves([_cycling(400, [2, 6, None], 8)], 8)
    even = 4 * 3
    alloc = allocate_slots(curves, even)
    assert sum(alloc) == even and min(alloc) >= 1
    assert alloc[0] == 2 and alloc[1] == 6 and alloc[2] == 4
    hits = sum(curves[il, n] for il, n in enumerate(alloc))
    assert hits > curves[:, 4].sum()  # more than the even split
    # weights (miss costs) move slots too: a dear enough layer 2 takes them from layer 1
    assert allocate_slots(curves, even, weights=[1.0, 1.0, 100.0])[2] > alloc[2]


def test_allocation_totals_and_minimums() -> None:
    curves = lru_hit_curves([_cycling(200, [2, 6, None], 8)], 8)
    assert allocate_slots(curves, 3) == [1, 1, 1]
    assert allocate_slots(curves, 100) == [8, 8, 8]  # at most every expert
    with pytest.raises(ValueError, match="cannot give 3 layers"):
        allocate_slots(curves, 2)
    flat = np.zeros((3, 9))
    assert allocate_slots(flat, 10) == [4, 3, 3]  # nothing gains: spread evenly
    # model layers: dense layers keep 0, the total is the even split's
    even = [0, 4, 4, 4]
    out = reallocate(even, [1, 2, 3], curves)
    assert out[0] == 0 and sum(out) == 12 and out[2] == 6
    assert reallocate([0, 1, 0, 1], [1, 2, 3], curves) == [0, 1, 0, 1]  # fewer slots than layers


# -- eviction orders ---------------------------------------------------------------------------
def test_lfu_evicts_the_least_frequently_used() -> None:
    lfu, lru = LFUPolicy([2]), LRUPolicy([2])
    for experts in ([1], [1], [2]):
        for pol in (lfu, lru):
            pol.on_gate(0, np.array(experts))
    # 1 is older but routed twice: LFU evicts 2, LRU evicts 1
    assert lfu.on_gate(0, np.array([3])) == [(3, 1)]
    assert lru.on_gate(0, np.array([3])) == [(3, 0)]
    # frequency counts routings, resident or not: 2 (twice now) outranks 3 (once)
    assert lfu.on_gate(0, np.array([2])) == [(2, 1)]
    # 1 and 2 both routed twice: the least recently used (1) goes
    assert lfu.on_gate(0, np.array([4])) == [(4, 0)]
    assert lfu.on_gate(0, np.array([5, 6, 7])) is None  # more experts than slots: from host


def _engine(n_slots: int) -> SimEngine:
    return SimEngine(shape_of("reference", "q8_0"), [n_slots] * 8, Profile.load("rtx4090"))


def _token(pol: InfinityPolicy, eng: SimEngine, experts: list[int],
           ranking: list[int] | None = None) -> int:
    """One token: layer 0 routes expert 0, a forecast ``ranking`` for layer 1 arrives, layer 1
    routes ``experts``; returns the copies the forecast queued."""
    queued = 0
    eng.new_pass()
    for layer, ids in ((0, [0]), (1, experts)):
        eng.begin_route(layer, ids)
        assert pol.gate(layer, np.array(ids), eng)
        eng.wait_until(lambda: eng.running is None and not any(eng.queue))
        if layer == 0 and ranking is not None:
            queued = pol.prefetch(1, ranking, eng.epoch, eng)
            eng.wait_until(lambda: eng.running is None and not any(eng.queue))
    return queued


def _resident(eng: SimEngine, layer: int = 1) -> set[int]:
    return {int(e) for e in eng.layer_state(layer)[0] if e >= 0}


def test_infinity_evicts_by_request_activation_then_prediction() -> None:
    eng = _engine(2)
    pol = InfinityPolicy([2] * 8, Features(split=False), prefetch_n=1)
    pol.attach(eng)
    for experts in ([1], [1], [2]):
        _token(pol, eng, experts)
    # the request routed 1 twice and 2 once: 2 goes, although 1 is the least recently used
    _token(pol, eng, [3])
    assert _resident(eng) == {1, 3}
    # a new request: its counts start over; the EAM prediction ranks 1 above 3, so 3 goes
    # (recency alone would evict 1)
    pol.begin_request()
    _token(pol, eng, [5], ranking=[1, 3])
    assert _resident(eng) == {1, 5}
    # a prefetch replaces only experts worth less than the predicted one: 1 and 5 were both
    # routed in this request, 7 was not
    _token(pol, eng, [1])
    assert _token(pol, eng, [5], ranking=[7]) == 0 and _resident(eng) == {1, 5}
    # with nothing routed yet in a request, the predicted expert takes the lowest slot
    pol.begin_request()
    assert _token(pol, eng, [1], ranking=[7]) == 1 and _resident(eng) == {1, 7}


# -- the simulator ------------------------------------------------------------------------------
def _requests(n_req: int = 4, seed: int = 0) -> list[Request]:
    """Reference-shaped routing (8 layers, 32 experts, top-4) that keeps half of each token's
    experts; layer l prefers the first 4 + 2l experts."""
    rng = np.random.default_rng(seed)
    L, k, T = 8, 4, 40
    out = []
    for _ in range(n_req):
        ex = np.zeros((T, L, k), np.int16)
        for t in range(T):
            for il in range(L):
                pool = np.arange(4 + 2 * il)
                keep = ex[t - 1, il, :2] if t else rng.choice(pool, 2, replace=False)
                rest = rng.choice(np.setdiff1d(pool, keep), k - 2, replace=False)
                ex[t, il] = np.r_[keep, rest]
        phase = np.r_[np.zeros(16, np.int8), np.ones(T - 16, np.int8)]
        out.append(Request(experts=ex, token_ids=rng.integers(0, 100, T).astype(np.int32),
                           phase=phase))
    return out


def test_simulator_takes_slots_per_layer() -> None:
    shape, profile = shape_of("reference", "q8_0"), Profile.load("rtx4090")
    reqs = _requests()
    per_layer = [4, 6, 8, 10, 12, 14, 16, 18]  # each layer's working set
    sim = Simulator(shape, profile, SimConfig("lru", n_slots=per_layer), list(range(8)))
    assert sim.n_slots == per_layer and [L.n_slots for L in sim.engine.layers] == per_layer
    even = simulate(reqs, shape, profile, SimConfig("lru", n_slots=11)).to_json()
    sized = simulate(reqs, shape, profile, SimConfig("lru", n_slots=per_layer)).to_json()
    assert sized["hits"] > even["hits"]  # the layers' pools fit their working sets
    # ncmoe places the same total budget as whole layers either way
    nc = [simulate(reqs, shape, profile, SimConfig("ncmoe", n_slots=n)).to_json()["hits"]
          for n in (11, per_layer)]
    assert nc[0] == nc[1]
    for policy in ("lfu", "infinity"):
        r = simulate(reqs, shape, profile, SimConfig(policy, n_slots=per_layer),
                     HistoryPredictor(8, 32, 4)).to_json()
        assert r["hits"] > 0
    with pytest.raises(ValueError, match="slot counts for a shape of 8 layers"):
        simulate(reqs, shape, profile, SimConfig("lru", n_slots=[4] * 7))


# -- losslessness on the CPU build ---------------------------------------------------------------
def _generate(model: Path, cfg: CacheConfig) -> list[tuple[list[int], np.ndarray]]:
    with Llama.open(model, n_ctx=512, n_batch=N_BATCH, n_threads=2, cache=cfg) as llm:
        text = text_tokens(llm, TEXT)
        out = []
        for n in (1, 64, 300):
            res = generate(llm, text[:n], 32, SamplingParams(greedy=True), ignore_eos=True)
            out.append((res.tokens, last_logits(llm)))
        assert llm.expert_cache is not None and llm.expert_cache.stats()["h2d_bytes"] > 0
        return out


@pytest.mark.parametrize("policy", ["infinity", "lfu"])
def test_lfu_and_infinity_are_lossless(tiny_model: Callable[[str], Path], policy: str,
                                       stock: StockReference, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path))  # infinity: no stored collection
    model = tiny_model("q8_0")
    with Llama.open(model, n_ctx=512, n_threads=2, cache=CacheConfig("offload")) as llm:
        text = text_tokens(llm, TEXT)
    runs = stock.run(model, [text[:n] for n in (1, 64, 300)], 32, n_ctx=512, n_batch=N_BATCH,
                     n_threads=2)
    for frac in (0.25, 0.5):
        got = _generate(model, CacheConfig(policy, cache_fraction=frac))
        for (tokens, logits), (ref_tokens, ref_steps) in zip(got, runs, strict=True):
            if stock.backend != "cpu":  # the GPU check: equal up to rounding
                from tests.conftest import assert_same_tokens

                assert_same_tokens(tokens, ref_tokens, ref_steps, f"{policy} {frac}")
                continue
            assert tokens == ref_tokens, (policy, frac)
            assert np.array_equal(logits, ref_steps[-1]), (policy, frac)


# -- the EAM collection at run time ---------------------------------------------------------------
def test_eam_predictor_from_a_stored_collection(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = str(REFERENCE_MODEL)
    gen = ("generate", "-m", model, "-p", "Once upon a time, in a small town by the sea,",
           "-n", "16", "--greedy", "--ignore-eos", "--json", "--cache-fraction", "0.5")
    # no collection yet: one line that names the commands making it
    res = run_cli(*gen, "--policy", "promoe", "--predictor", "eam")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no EAM collection" in lines[0]
    assert "forecache trace" in lines[0] and "forecache train" in lines[0]
    assert "--predictor eam" in lines[0]

    trace = tmp_path / "ref.npz"
    run_cli("trace", "-m", model, "--builtin", "default", "--limit", "8", "-n", "16",
            "--out", str(trace), check=True)
    run_cli("train", "-m", model, "--trace", str(trace), "--predictor", "eam", check=True)
    import json

    ref = json.loads(run_cli(*gen[:-2], "--policy", "offload", check=True).stdout)["tokens"]
    for policy in ("promoe", "infinity"):
        out = run_cli(*gen, "--policy", policy, "--predictor", "eam", check=True)
        assert json.loads(out.stdout)["tokens"] == ref, policy

    # the collection and the reuse it recorded reach the runtime
    from forecache.gguf.header import read_model_file
    from forecache.placement.build import make_forecaster
    from forecache.predictor.store import load_eam

    mf = read_model_file(REFERENCE_MODEL)
    col = load_eam(mf)
    assert col.eams.shape[0] == 8 and col.hit_curves.shape == (len(mf.moe_layers()),
                                                              mf.n_expert + 1)
    cfg = CacheConfig("infinity", cache_fraction=0.5)
    with Llama.open(REFERENCE_MODEL, n_ctx=256, cache=cfg) as llm:
        assert llm.placement is not None
        slots = [llm.placement.n_slots[il] for il in mf.moe_layers()]
        assert sum(slots) == len(slots) * (mf.n_expert // 2) and min(slots) >= 1
        worker = llm.expert_cache.worker if llm.expert_cache else None
        assert worker is not None and worker.forecaster.predictor.collection_size == 8
    fc = make_forecaster(mf, CacheConfig("promoe", cache_fraction=0.5, predictor="eam"),
                         [4] * mf.n_layer)
    assert fc.predictor.name == "eam" and fc.window == 2
