"""The simulator's disk tier (issue 38): host slots over the model file, reads shared by the disk,
eviction by uses then recency, llama.cpp's page-faulting mmap as the baseline, and the shapes of
models larger than host memory."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from forecache.cache.cost import DiskProfile, Profile
from forecache.cache.prefetcher import HIGH, LOW
from forecache.gguf.maker import make_model
from forecache.gguf.specs import get_spec, size_report, tensor_plan
from forecache.predictor.history import HistoryPredictor
from forecache.sim.belady import belady_misses, min_reads
from forecache.sim.disk_reads import host_slots_for, predict_disk_reads
from forecache.sim.engine import SimEngine
from forecache.sim.hosttier import PageCache, fault_s
from forecache.sim.shapes import ModelShape, shape_of
from forecache.sim.simulate import SimConfig, simulate
from forecache.trace import synth
from forecache.trace.format import Request

# one layer of 8 experts, 3 projections of 1 MB: reads at 1 GB/s with 10 us a projection
SHAPE = ModelShape(name="hand", layers=1, experts=8, top_k=2, d_model=256, expert_ff=256,
                   proj_bytes=(1_000_000,) * 3, layer_bytes=100_000, head_bytes=100_000,
                   qtype="q8_0")
DISK = DiskProfile(gbps=1.0, latency_us=10.0, queue_depth=4)


def _profile(disk: DiskProfile | None = DISK) -> Profile:
    return replace(Profile.load("rtx4090"), disk=disk)


def _engine(n_host: int, n_slots: int = 2) -> SimEngine:
    eng = SimEngine(SHAPE, [n_slots], _profile(), whole_expert_chunks=True)
    eng.attach_disk([n_host])
    return eng


def _idle(eng: SimEngine) -> None:
    eng.wait_until(lambda: eng.running is None and not any(eng.queue) and
                   not eng.disk.flying and not eng.disk.queued)


def _held(eng: SimEngine) -> set[int]:
    return {e for e in eng.disk.layers[0].expert_of if e >= 0}


# -- the host tier on hand-made routing --------------------------------------------------------
def test_a_copy_waits_for_its_read_and_reads_share_the_disk() -> None:
    eng = _engine(n_host=4)
    eng.load(0, 5, 0, HIGH)
    eng.load(0, 6, 1, HIGH)
    assert eng.running is None  # both copies wait for their experts' reads
    _idle(eng)
    tier = eng.disk
    assert tier.stats.reads == 2 and tier.stats.misses == 2 and tier.stats.hits == 0
    assert tier.stats.bytes == 2 * SHAPE.expert_bytes
    # two reads at once: three latencies each, then 6 MB through 1 GB/s together
    both = 3 * DISK.latency_s + 2 * SHAPE.expert_bytes / 1e9
    assert tier.ready_at[(0, 5)] == pytest.approx(both)
    assert tier.ready_at[(0, 6)] == pytest.approx(both)
    expert_of, _ = eng.layer_state(0)
    assert sorted(expert_of.tolist()) == [5, 6]
    # a copy of an expert the host tier holds reads nothing
    eng.load(0, 5, 1, HIGH)
    _idle(eng)
    assert tier.stats.reads == 2 and tier.stats.hits == 1


def test_eviction_takes_the_least_used_then_least_recent_expert_nothing_wants() -> None:
    eng = _engine(n_host=3)
    tier = eng.disk
    for e, s in ((0, 0), (1, 1), (2, 0), (0, 1)):  # 0 is copied twice: used most
        eng.load(0, e, s, HIGH)
        _idle(eng)
    assert _held(eng) == {0, 1, 2} and tier.stats.reads == 3 and tier.stats.hits == 1
    # full: a new expert takes 1's host slot (one use, like 2, but used longer ago)
    eng.load(0, 3, 0, HIGH)
    _idle(eng)
    assert _held(eng) == {0, 2, 3} and tier.stats.evictions == 1
    # 2 is now the least used, least recent; a host compute that wants it keeps it
    tier.want(0, 2, +1)
    tier.request(0, 4, HIGH)
    _idle(eng)
    assert _held(eng) == {0, 2, 4}
    # a read alone is no use: 4, read ahead and never copied, is the first to go
    tier.want(0, 2, -1)
    tier.request(0, 5, HIGH)
    _idle(eng)
    assert _held(eng) == {0, 2, 5}
    eng.load(0, 5, 1, HIGH)  # now 5 has one use, as 2: 2 is older
    _idle(eng)
    tier.request(0, 6, HIGH)
    _idle(eng)
    assert _held(eng) == {0, 5, 6} and tier.stats.evictions == 4


def test_a_needed_read_goes_before_predicted_ones() -> None:
    eng = _engine(n_host=8)
    tier = eng.disk
    tier.disk = replace(DISK, queue_depth=1)  # one reader: the order shows
    for e in (1, 2, 3):
        tier.request(0, e, LOW)  # 1 starts at once, 2 and 3 queue
    tier.request(0, 4, HIGH)
    _idle(eng)
    order = sorted((tier.ready_at[(0, e)], e) for e in (1, 2, 3, 4))
    assert [e for _, e in order] == [1, 4, 2, 3]


def test_reads_served_in_order_end_one_after_another_and_needed_ones_overtake() -> None:
    eng = SimEngine(SHAPE, [2], _profile(), whole_expert_chunks=True)
    tier = eng.attach_disk([8], ordered=True)
    one = SHAPE.expert_bytes / 1e9
    lat = 3 * DISK.latency_s
    tier.request(0, 1, LOW)
    tier.request(0, 2, LOW)
    # a needed read, once its latencies are over, takes the disk from the predicted ones
    eng.at(lat + one / 2, lambda: tier.request(0, 3, HIGH))
    _idle(eng)
    t = {e: tier.ready_at[(0, e)] for e in (1, 2, 3)}
    assert t[3] < t[1] < t[2]
    # the full rate to one read at a time: 1 flows on through 3's latencies, 3 then takes the
    # disk for its own bytes, 1 moves what it has left, 2 last with every byte moved by then
    assert t[3] == pytest.approx(lat + one / 2 + lat + one, rel=1e-6)
    assert t[1] == pytest.approx(t[3] + one / 2 - lat, rel=1e-6)
    assert t[2] == pytest.approx(t[1] + one, rel=1e-6)
    assert tier.stats.reads == 3


def test_a_schedule_streaming_more_experts_than_host_slots_completes() -> None:
    eng = _engine(n_host=3, n_slots=1)
    tier = eng.disk
    tier.disk = replace(DISK, queue_depth=1)
    for e in (1, 2):
        tier.request(0, e, LOW)
    _idle(eng)
    tier.request(0, 3, LOW)  # the one reader is busy with 3 when the schedule comes
    # 0 streams first through the one device slot, then 1, 2 and 3: when the reader is free,
    # every host slot holds an expert later entries want; 0's read takes the slot of one whose
    # copies all wait for the device slot, which is read again once its copy could run
    assert eng.schedule(0, [0, 1, 2, 3], [0, 0, 0, 0], HIGH) == 0
    for i in range(4):
        eng.wait_until(lambda i=i: all(eng.entry_ready(0, i, p) for p in range(3)))
        for p in range(3):
            eng.consume(0, [i], p)
    assert tier.stats.displaced == 1
    assert tier.stats.reads == 3 + 2  # 0, and the expert it displaced read again
    # a host compute's experts are never taken
    L = tier.layers[0]
    first = L.expert_of[tier._victim(0, L)]
    tier.compute(0, first, +1)
    assert L.expert_of[tier._victim(0, L)] != first


# -- the disk tier in a replay --------------------------------------------------------------------
def _routing(n_layers: int = 4, n_expert: int = 16, top_k: int = 4, seed: int = 1
             ) -> list[Request]:
    p = synth.SynthParams(skew=1.0, focus=0.4, stick=0.3, follow=0.3)
    return synth.synthesize(p, n_layers=n_layers, n_expert=n_expert, top_k=top_k,
                            tokens=[72] * 3, prefill=[24] * 3, seed=seed)


def test_a_budget_that_holds_every_expert_reads_nothing_and_times_the_same() -> None:
    shape, prof = shape_of("tiny", "q8_0"), _profile()
    reqs = _routing()
    for policy in ("lru", "promoe", "ncmoe-mmap"):
        base = simulate(reqs, shape, prof, SimConfig(policy, 4))
        full = simulate(reqs, shape, prof, SimConfig(policy, 4, host_slots=shape.experts))
        assert full.disk_reads == 0 and full.host_hit_rate is None, policy
        assert (full.ttft_s, full.tpot_s, full.hits, full.h2d_bytes) == \
            (base.ttft_s, base.tpot_s, base.hits, base.h2d_bytes), policy
        # one slot fewer and the file is read
        less = simulate(reqs, shape, prof, SimConfig(policy, 4, host_slots=shape.experts // 4))
        assert less.disk_reads > 0 and less.tpot_s > base.tpot_s, policy
    # host budgets in bytes: what every expert takes is every slot
    every = shape.expert_bytes * shape.experts * shape.layers
    assert host_slots_for(shape, every) == shape.experts
    assert host_slots_for(shape, every - 1) == shape.experts - 1


def test_reads_per_token_fall_as_the_host_budget_grows() -> None:
    shape, prof = shape_of("tiny", "q8_0"), _profile()
    reqs = _routing()
    per_token, hit = [], []
    for n_host in (4, 6, 8, 12, 16):
        r = predict_disk_reads(reqs, shape, n_host, 4, profile=prof)
        per_token.append(r.per_token)
        hit.append(r.host_hit_rate or 1.0)
    assert all(a > b for a, b in zip(per_token, per_token[1:-1], strict=False)), per_token
    assert per_token[-1] == 0.0
    assert all(a <= b for a, b in zip(hit, hit[1:], strict=False)), hit
    # the reads follow the routing: the same replay reads the same
    again = predict_disk_reads(reqs, shape, 6, 4, profile=prof)
    assert again.per_token == per_token[1]


def test_the_disk_window_reads_predicted_experts_ahead() -> None:
    shape, prof = shape_of("tiny", "q8_0"), _profile()
    reqs = _routing(seed=4)
    pred = HistoryPredictor(shape.layers, shape.experts, shape.top_k)
    pred.fit(reqs[:1])
    # (the hot path this was established on: with today's, the tiny routing's two hit rates
    # come within 0.1% of each other, and the window's reads buy nothing measurable here)
    runs = {w: simulate(reqs[1:], shape, prof,
                        SimConfig("promoe", 4, window=1, host_slots=8, disk_window=w,
                                  hot_path="groups"), pred)
            for w in (0, 2)}
    # reads the window asks for are reads no copy needed: more reads, more of the needed
    # experts read before they are needed
    assert runs[2].disk_reads > runs[0].disk_reads
    assert runs[2].host_hit_rate > runs[0].host_hit_rate


# -- llama.cpp's page-faulting mmap ----------------------------------------------------------------
def test_the_mmap_baseline_faults_when_the_model_exceeds_host_memory() -> None:
    shape, prof = shape_of("tiny", "q8_0"), _profile()
    reqs = _routing()
    fits = simulate(reqs, shape, prof, SimConfig("ncmoe-mmap", 2))
    runs = [simulate(reqs, shape, prof, SimConfig("ncmoe-mmap", 2, host_slots=n))
            for n in (12, 6, 3)]
    assert fits.disk_reads == 0
    tpot = [fits.tpot_s] + [r.tpot_s for r in runs]
    assert all(a < b for a, b in zip(tpot, tpot[1:], strict=False)), tpot
    assert all(0 < r.disk_reads and r.host_hit_rate < 1 for r in runs)
    # deeper fault queues hide latency, so they are faster, never slower than reading alone
    deep = simulate(reqs, shape, prof, SimConfig("ncmoe-mmap", 2, host_slots=3, fault_qd=8))
    assert fits.tpot_s < deep.tpot_s < runs[-1].tpot_s
    # --no-mmap reads every host expert into memory: such a model cannot load
    with pytest.raises(ValueError, match="cannot load"):
        simulate(reqs, shape, prof, SimConfig("ncmoe", 2, host_slots=3))


def test_page_faults_cost_a_latency_per_read_ahead_window() -> None:
    disk = DiskProfile(gbps=2.0, latency_us=50.0, readahead_kib=128)
    t, n = fault_s((1 << 20, 1 << 20, 1 << 20), disk)  # 8 windows a projection
    assert n == 24
    assert t == pytest.approx(24 * 50e-6 + 3 * (1 << 20) / 2e9)
    t8, _ = fault_s((1 << 20,) * 3, disk, queue_depth=8)
    assert t8 == pytest.approx(3 * 50e-6 + 3 * (1 << 20) / 2e9)
    cache = PageCache(2)
    assert cache.access(0, [1, 2]) == [1, 2]
    assert cache.access(0, [1]) == []  # 1 is now the most recent
    assert cache.access(1, [1]) == [1]  # another layer's expert pushes out 2, not 1
    assert cache.access(0, [1, 2]) == [2]


def test_a_disk_tier_needs_a_disk_in_the_profile() -> None:
    shape = shape_of("tiny", "q8_0")
    with pytest.raises(ValueError, match="no disk section"):
        simulate(_routing(), shape, _profile(None), SimConfig("lru", 4, host_slots=4))
    disk = Profile.load("rtx4090").disk
    assert disk is not None and disk.gbps == 7.0 and disk.queue_depth >= 1


# -- shapes larger than host memory ------------------------------------------------------------
def test_big_shapes_follow_their_configs() -> None:
    q235 = size_report(get_spec("qwen3-235b-a22b"), "q4_k_m")
    assert q235.total_params == pytest.approx(235e9, rel=0.01)
    assert q235.total_bytes == pytest.approx(142e9, rel=0.03)  # the published Q4_K_M
    spec = get_spec("qwen3.5-397b-a17b")
    rep = size_report(spec, "q4_k")
    assert rep.total_params == pytest.approx(397e9, rel=0.01)
    assert rep.expert_bytes == 3 * 4096 * 1024 * 144 // 256  # q4_k: 144 bytes a 256 block
    assert rep.total_expert_bytes == rep.expert_bytes * 512 * 60
    names = [t.name for t in tensor_plan(spec, "q4_k")]
    assert sum(n.endswith("ssm_out.weight") for n in names) == 45
    assert sum(n.endswith("attn_k.weight") for n in names) == 15
    shape = shape_of("qwen3.5-397b-a17b", "q4_k")
    assert (shape.layers, shape.experts, shape.top_k) == (60, 512, 10)
    assert shape.expert_bytes == rep.expert_bytes
    assert shape.dense_bytes == pytest.approx(rep.nonexpert_bytes, rel=0.1)


def test_make_model_refuses_a_shape_it_cannot_write(tmp_path: Path) -> None:
    out = tmp_path / "big.gguf"
    with pytest.raises(ValueError, match="cannot write qwen3.5-397b-a17b") as err:
        make_model(out, "qwen3.5-397b-a17b", "q4_k", n_layers=4)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_scale_free_statistics_measure_reuse_above_chance() -> None:
    summary = {"load_entropy": 0.9, "request_entropy": 0.8, "nmi_adjusted": 0.2,
               "reuse": {1: 0.5, 4: 0.6, 16: 0.9}, "reuse_independent": {1: 0.5, 4: 0.2, 16: 0.8},
               "cond_accuracy": 0.4, "popular_accuracy": 0.25}
    got = synth.scale_free_values(summary)
    assert got["reuse@1"] == 0.0  # no more reuse than independent routing gives
    assert got["reuse@4"] == pytest.approx(0.5) and got["reuse@16"] == pytest.approx(0.5)
    assert got["cond_accuracy"] == pytest.approx(0.2)
    assert got["load_entropy"] == 0.9 and got["nmi_adjusted"] == 0.2
    assert np.isfinite(list(got.values())).all()


# -- the fewest reads a routing allows (Belady) ----------------------------------------------------
def _brute_min(seq: list[int], cap: int, start: frozenset[int] = frozenset()) -> int:
    """The fewest misses of ``seq`` with ``cap`` slots from ``start``, by trying every choice
    (keep or not, and which to evict) at every miss."""
    @cache
    def go(i: int, held: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        e = seq[i]
        if e in held:
            return go(i + 1, held)
        best = go(i + 1, held)  # not kept
        if len(held) < cap:
            best = min(best, go(i + 1, held | {e}))
        else:
            for v in held:
                best = min(best, go(i + 1, (held - {v}) | {e}))
        return 1 + best

    return go(0, start)


def test_belady_is_the_fewest_reads_any_replacement_makes() -> None:
    rng = np.random.default_rng(3)
    for _ in range(12):
        seq = rng.integers(0, 6, size=14).tolist()
        steps = [[e] for e in seq]
        for cap in (1, 2, 3):
            assert min_reads(steps, cap) == _brute_min(seq, cap)
            # the best start: the fewest misses over every starting content
            starts = [frozenset(c) for c in combinations(range(6), cap)]
            assert min_reads(steps, cap, free_start=True) == \
                min(_brute_min(seq, cap, s) for s in starts)
    # per step: a token's experts together, counted at their step
    got = belady_misses([[0, 1], [2, 3], [0, 1], [2, 3]], 2)
    assert got.tolist() == [2, 2, 0, 2]  # 2 and 3 go past 0 and 1, used sooner: not kept
    assert min_reads([[0, 1], [2, 3], [0, 1], [2, 3]], 4) == 4  # cold reads only


def test_belady_bounds_every_simulated_policys_decode_reads() -> None:
    shape, prof = shape_of("tiny", "q8_0"), _profile()
    reqs = _routing(seed=2)
    n_host, n_slots = 6, 4
    bound = 0
    for il in range(shape.layers):
        for r in reqs:
            dec = [[int(e) for e in r.experts[t, il] if e >= 0]
                   for t in np.flatnonzero(r.phase == 1)]
            bound += min_reads(dec, n_host + n_slots, free_start=True)
    pred = HistoryPredictor(shape.layers, shape.experts, shape.top_k)
    pred.fit(reqs[:1])
    base = SimConfig("lru", n_slots, window=1, host_slots=n_host)
    runs = [simulate(reqs, shape, prof, base),
            simulate(reqs, shape, prof, replace(base, policy="promoe"), pred),
            simulate(reqs, shape, prof, replace(base, policy="promoe", disk_window=2), pred),
            simulate(reqs, shape, prof, replace(base, policy="promoe", host_exclusive=True),
                     pred)]
    assert bound > 0
    for r in runs:
        assert r.decode_disk_reads >= bound, (r.decode_disk_reads, bound)


def test_exclusive_tiers_free_a_device_experts_host_slot_and_write_it_back() -> None:
    eng = SimEngine(SHAPE, [1], _profile(), whole_expert_chunks=True)
    tier = eng.attach_disk([2], exclusive=True)
    eng.load(0, 5, 0, HIGH)
    _idle(eng)
    assert eng.copied(0, 5) and tier.present(0, 5)
    assert eng.schedule(0, [5], [0], HIGH) == 0  # computed from its device slot
    for p in range(3):
        eng.consume(0, [0], p)
    for e in (1, 2):  # the second read takes 5's host slot: the device holds it
        tier.request(0, e, LOW)
        _idle(eng)
    assert _held(eng) == {1, 2} and tier.stats.reads == 3
    # the next pass: 6 takes 5's device slot; 5 is written back over the bus, not read again
    eng.begin_route(0)
    assert eng.load(0, 6, 0, HIGH) == 0
    _idle(eng)
    assert tier.stats.demoted == 1 and tier.present(0, 5) and 5 not in eng.layers[0].slot_of
    assert _held(eng) == {5, 6} and tier.stats.reads == 4
    # without exclusive tiers nothing is written back
    eng = SimEngine(SHAPE, [1], _profile(), whole_expert_chunks=True)
    tier = eng.attach_disk([2])
    for e in (5, 6):
        eng.load(0, e, 0, HIGH)
        _idle(eng)
    assert tier.stats.demoted == 0 and _held(eng) == {5, 6}


def test_request_eviction_counts_the_current_requests_uses() -> None:
    eng = SimEngine(SHAPE, [2], _profile(), whole_expert_chunks=True)
    tier = eng.attach_disk([2], evict="request")
    for e in (1, 1, 1, 2):  # 1 used most, in an earlier request
        tier.use(0, e, HIGH)
        _idle(eng)
    tier.begin_request()
    tier.use(0, 2, HIGH)  # 2 used in this one
    tier.use(0, 3, HIGH)  # takes 1's slot: fewer uses this request, though more in all
    _idle(eng)
    assert _held(eng) == {2, 3}


def test_request_counts_keep_a_requests_favourites_past_a_scan() -> None:
    """benchmarks/disk_bound.py's request-count policy: a request that keeps returning to two
    experts between one-off ones keeps them (the one-offs are not let in), where LRU of two
    slots loses them to every one-off; knowing the totals in advance or counting as it goes
    both do, and neither reads fewer than Belady."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from disk_bound import layer_steps, lru_decode_misses, request_count_misses

    seq = [0, 1, 5, 0, 1, 6, 0, 1, 7, 0, 1, 8, 0, 1, 9]
    prompt = Request(experts=np.array([[[0]], [[1]], [[0]], [[1]]], dtype=np.int16),
                     phase=np.zeros(4, dtype=np.int8))
    dec = Request(experts=np.array([[[e]] for e in seq], dtype=np.int16),
                  phase=np.ones(len(seq), dtype=np.int8))
    run = [replace(prompt, experts=np.concatenate([prompt.experts, dec.experts]),
                   phase=np.concatenate([prompt.phase, dec.phase]))]
    steps, decode = layer_steps(run, 0)
    mask = np.array(decode)
    lru = lru_decode_misses(steps, mask, 2)
    oracle = request_count_misses(run, 0, 0, 2, oracle=True)
    online = request_count_misses(run, 0, 0, 2, oracle=False)
    best = int(belady_misses(steps, 2)[mask].sum())
    assert lru == len(seq) - 2 and oracle == online == 5  # only the one-offs are read
    assert best <= oracle
