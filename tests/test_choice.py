"""The default placement's guard: promoe only where the cost model expects it to decode at least
as fast as --n-cpu-moe, from the model's measured routing (or uniform routing) and rates."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from forecache.cache.choice import (
    MARGIN,
    PRIOR,
    DecodeShape,
    Evidence,
    choose,
    choose_among,
    distinct_experts,
    hit_at,
    locality,
    ncmoe_prompt_s,
    promoe_decode_s,
    promoe_filled_s,
    promoe_prompt_s,
)
from forecache.cache.cost import CostModel, ExpertShape, Profile
from forecache.cache.measured import MIN_LOOKUPS, load_evidence, record_path, record_run
from forecache.gguf.header import read_model_file
from forecache.native.ggml_devices import Device, cache_device
from forecache.placement.costs import DEFAULT_GPU_MACHINE, default_machine, split_cost
from forecache.placement.options import CacheConfig
from forecache.sim.run import decode_shape, run_one, slots_for
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig
from forecache.trace import synth
from forecache.trace.format import Request
from forecache.trace.stats import lru_hit_rate
from tests.cli_helpers import run_cli

RTX4090 = Profile.load("rtx4090")


def test_lru_hit_rate_replays_one_stream() -> None:
    seq = [0, 1, 0, 2, 0, 1]  # two slots: miss miss hit miss(evicts 1) hit miss
    req = Request(experts=np.array(seq, np.int16).reshape(6, 1, 1),
                  phase=np.array([0, 0, 0, 1, 1, 1], np.int8))
    assert lru_hit_rate([req], 2) == pytest.approx(2 / 6)
    assert lru_hit_rate([req], 2, phase=1) == pytest.approx(1 / 3)  # rows 3-5 only
    assert lru_hit_rate([req], 3) == pytest.approx(3 / 6)
    with pytest.raises(ValueError, match="at least one slot"):
        lru_hit_rate([req], 0)


def test_locality_inverts_hit_at() -> None:
    for share in (0.25, 0.5, 0.67):
        for loc in (0.0, 0.3, 0.9):
            assert locality(hit_at(share, loc), share) == pytest.approx(loc)
    assert locality(0.1, 0.5) == 0.0  # below uniform reads as none


def test_target_needs_measured_locality_for_promoe() -> None:
    """Qwen2-57B-A14B q4_k at 24 GiB: uniform routing leaves ncmoe ahead; the locality real
    64-expert top-8 routing shows (OLMoE: 0.65-0.78 at these shares) puts promoe ahead; more
    locality never makes promoe slower."""
    sh = shape_of("qwen2-57b-a14b", "q4_k")
    n = slots_for(sh, sh.layers, "24GiB", None)
    ds = decode_shape(sh, n)
    cost = CostModel.from_profile(RTX4090, sh.expert)
    prior = choose(ds, RTX4090, cost, PRIOR)
    assert prior.policy == "ncmoe"
    assert "prior: uniform routing" in prior.reason() and "--policy promoe" in prior.reason()
    measured = choose(ds, RTX4090, cost, Evidence(0.65, "run", 4096))
    assert measured.policy == "promoe" and measured.promoe_s < measured.ncmoe_s
    assert measured.ncmoe_s == pytest.approx(prior.ncmoe_s)
    choices = [choose(ds, RTX4090, cost, Evidence(x, "run", 1)) for x in np.linspace(0, 1, 21)]
    times = [c.promoe_s for c in choices]
    assert all(b <= a + 1e-12 for a, b in zip(times, times[1:], strict=False))
    # promoe only where its estimate wins by the margin; somewhere it wins by less and is not taken
    for c in choices:
        assert (c.policy == "promoe") == (c.ncmoe_s / c.promoe_s >= MARGIN)
    assert any(1.0 < c.ncmoe_s / c.promoe_s < MARGIN and c.policy == "ncmoe" for c in choices)
    # a slower measured copy rate or CPU makes promoe's estimate slower, never faster
    slow = choose(ds, RTX4090, cost, Evidence(0.65, "run", 4096, copy_gbps=8.0, host_scale=2.0))
    assert slow.promoe_s > measured.promoe_s and slow.ncmoe_s > measured.ncmoe_s


def test_stock_placement_when_every_expert_fits() -> None:
    """With every expert in the budget ncmoe keeps every layer on the device: the default is
    llama.cpp's own placement whatever the routing, and says why."""
    sh = shape_of("qwen2-57b-a14b", "q4_k")
    ds = decode_shape(sh, sh.experts)
    ds = DecodeShape(**{**ds.__dict__, "ncmoe_host_layers": 0})
    cost = CostModel.from_profile(RTX4090, sh.expert)
    for ev in (PRIOR, Evidence(0.95, "run", 4096)):
        c = choose(ds, RTX4090, cost, ev)
        assert c.policy == "ncmoe" and "every routed expert fits" in c.reason()


def test_cache_fills_are_charged_where_the_bus_cannot_carry_them() -> None:
    """Mixtral's 99 MB experts: admitting every miss would take more bus time than a token has,
    so the estimate admits fewer (a lower hit rate) and slows the CPU's experts while the fills
    copy; a cache that never misses fills nothing and costs what the plain estimate says."""
    sh = shape_of("mixtral-8x7b", "q4_k")
    ds = decode_shape(sh, 5)
    cost = CostModel.from_profile(RTX4090, sh.expert)
    share, loc = 5 / 8, 0.28
    plain = promoe_decode_s(ds, RTX4090, cost, hit_at(share, loc))
    filled, hit = promoe_filled_s(ds, RTX4090, cost, share, loc)
    fills = ds.n_moe * ds.top_k * (1 - hit) * cost.copy_s()
    assert hit < hit_at(share, loc) and filled > plain
    assert fills > filled  # even the admitted misses' fills outlast a token: the bus is full
    assert promoe_filled_s(ds, RTX4090, cost, share, 1.0) == \
        (promoe_decode_s(ds, RTX4090, cost, 1.0), 1.0)
    # the simulator puts ncmoe ahead here (benchmarks/default_guard.py): so does the guard
    assert choose(ds, RTX4090, cost, Evidence(loc, "trace", 1)).policy == "ncmoe"


@pytest.mark.parametrize("shape,share,params", [
    ("qwen2-57b-a14b", None, synth.OLMOE_FIT),
    ("granite-3.0-1b-a400m", 0.55, synth.SynthParams(skew=0.8, focus=0.5, stick=0.3,
                                                     follow=0.4)),
])
def test_guard_agrees_with_the_simulator(shape: str, share: float | None,
                                         params: synth.SynthParams) -> None:
    """Given the locality the simulator's promoe reached, the guard picks the policy the
    simulator finds faster at decode, and its ncmoe estimate is the simulator's within 5%."""
    sh = shape_of(shape, "q4_k")
    n = slots_for(sh, sh.layers, "24GiB" if share is None else None, share)
    reqs = synth.synthesize(params, n_layers=sh.layers, n_expert=sh.experts, top_k=sh.top_k,
                            tokens=[48, 48], prefill=[0, 0], seed=1)
    sim = {p: run_one(reqs, sh, RTX4090, SimConfig(p, n), None) for p in ("ncmoe", "promoe")}
    faster = min(sim, key=lambda p: sim[p].tpot_s)
    hit = sim["promoe"].hits / (sim["promoe"].hits + sim["promoe"].misses)
    got = choose(decode_shape(sh, n), RTX4090, CostModel.from_profile(RTX4090, sh.expert),
                 Evidence(locality(hit, n / sh.experts), "run", 1))
    assert got.policy == faster, (got.reason(), {p: r.tpot_s for p, r in sim.items()})
    assert got.ncmoe_s == pytest.approx(sim["ncmoe"].tpot_s, rel=0.05)


def test_measured_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         tiny_model) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = read_model_file(tiny_model("q8_0"))
    cost = CostModel.from_profile(RTX4090, ExpertShape.of(model))
    assert load_evidence(model, "GPU0", 0.5) is None
    assert not record_run(model, "GPU0", 0.5, 10, MIN_LOOKUPS - 11, cost)  # too little decode
    assert not record_path(model).exists()
    cost.copy_gbps, cost.copy_measured, cost.host_scale = 12.0, True, 1.5
    assert record_run(model, "GPU0", 0.5, 750, 250, cost)  # hit 0.75 at 0.5: locality 0.5
    ev = load_evidence(model, "GPU0", 0.5)
    assert ev is not None and ev.source == "run" and ev.lookups == 1000
    assert ev.locality == pytest.approx(0.5) and ev.copy_gbps == 12.0 and ev.host_scale == 1.5
    assert load_evidence(model, "GPU0", 0.4) is None  # measured above the share: not used
    assert load_evidence(model, "GPU0", 0.7).share == pytest.approx(0.5)  # nearest below
    other = load_evidence(model, "GPU1", 0.5)
    assert other is not None and other.copy_gbps is None and other.host_scale == 1.0
    assert record_run(model, "GPU0", 0.51, 2500, 500, cost)  # same grid point: weighted
    ev = load_evidence(model, "GPU0", 0.5)
    assert ev.lookups == 4000
    want = (0.5 * 1000 + locality(2500 / 3000, 0.51) * 3000) / 4000
    assert ev.locality == pytest.approx(want)
    # a damaged point is skipped; an unreadable file reads as nothing measured
    data = json.loads(record_path(model).read_text())
    data["locality"].append(["x"])
    record_path(model).write_text(json.dumps(data))
    assert load_evidence(model, "GPU0", 0.5).lookups == 4000
    record_path(model).write_text("{not json")
    assert load_evidence(model, "GPU0", 0.5) is None
    assert record_run(model, "GPU0", 0.5, 750, 250, cost)  # rewritten whole
    assert load_evidence(model, "GPU0", 0.5).lookups == 1000


def test_split_starts_from_the_measured_rates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              tiny_model) -> None:  # type: ignore[no-untyped-def]
    """promoe's split starts from the rates the last run on this device measured, not from the
    default profile's; a profile named on purpose is taken as it is."""
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = read_model_file(tiny_model("q8_0"))
    dev = cache_device()
    cfg = CacheConfig(policy="promoe", cache_fraction=0.5)
    start = split_cost(model, cfg, dev)
    assert (start.copy_gbps, start.host_scale) == (RTX4090.h2d_gbps, 1.0)  # nothing measured
    ran = CostModel.from_profile(RTX4090, ExpertShape.of(model))
    ran.copy_gbps, ran.copy_measured, ran.host_scale = 41.5, True, 2.5
    assert record_run(model, dev.name, 0.5, 750, 250, ran)
    cost = split_cost(model, cfg, dev)
    assert (cost.copy_gbps, cost.host_scale, cost.copy_measured) == (41.5, 2.5, True)
    # a run that measures the copies too little to correct them keeps the rate on record
    assert record_run(model, dev.name, 0.5, 750, 250, cost)
    assert split_cost(model, cfg, dev).copy_gbps == 41.5
    named = split_cost(model, CacheConfig(policy="promoe", cache_fraction=0.5,
                                          machine="rtx4090"), dev)
    assert (named.copy_gbps, named.host_scale) == (RTX4090.h2d_gbps, 1.0)
    other = split_cost(model, cfg, None)
    assert other.copy_gbps == RTX4090.h2d_gbps


def test_gpu_splits_plan_with_the_gpu_measured_profile() -> None:
    """On a GPU the split starts from the profile measured on a GPU run, whose hand-off of a
    projection's host rows costs what the GPU showed; a CPU build keeps the 4090 host's."""
    gpu = Device(0, "CUDA0", "NVIDIA H200", "gpu", "CUDA", 143 << 30, 140 << 30)
    assert default_machine(gpu) == DEFAULT_GPU_MACHINE
    assert default_machine(cache_device()) == "rtx4090"
    assert default_machine(None) == "rtx4090"
    measured = Profile.load(DEFAULT_GPU_MACHINE)
    assert measured.h2d_gbps == 55.2 and measured.thread_s > 10 * RTX4090.thread_s


def test_run_states_its_choice_and_learns_the_routing(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU build with a machine profile named, ``forecache run`` with no policy states
    the choice in one line; a promoe run keeps its decode hit rate, and the next choice says it
    used it. The reference model's experts are small: ncmoe either way."""
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    args = ("run", "--gpu-budget", "300MiB", "--machine", "rtx4090", "-n", "40")
    first = run_cli(*args, check=True)
    line = next(x for x in first.stderr.splitlines() if x.startswith("policy "))
    assert line.startswith("policy ncmoe:") and "prior: uniform routing" in line
    assert "[experts: ncmoe" in first.stderr
    named = run_cli(*args, "--policy", "promoe", check=True)
    assert not any(x.startswith("policy ") for x in named.stderr.splitlines())
    (rec,) = (tmp_path / "cache" / "measured").glob("*.json")
    points = json.loads(rec.read_text())["locality"]
    assert len(points) == 1 and points[0][3] == "run"
    mf = read_model_file(Path(__file__).resolve().parents[1] / "forecache" / "data" / "models" /
                   "forecache-ref-q8_0.gguf")
    per_token = len(mf.moe_layers()) * mf.n_expert_used
    assert 37 * per_token <= points[0][2] <= 40 * per_token  # the decode gates' lookups
    again = run_cli(*args, check=True)
    line = next(x for x in again.stderr.splitlines() if x.startswith("policy "))
    assert re.search(r"measured by a promoe run, \d+ decode lookups", line), line


H100 = Profile.load("h100-xeon")


def test_a_prompt_estimated_slower_keeps_stock_placement() -> None:
    """The default weighs both phases: at 12 GiB (a quarter of the target's experts in slots) a
    decode with OLMoE-like locality is estimated well ahead of --n-cpu-moe, but without prompt
    banks each layer's 50 missing experts stream through its slots as groups, estimated slower
    than stock's op offload: stock's placement. With banks the prompt's fills run beside the
    layer before, and promoe is chosen."""
    sh = shape_of("qwen2-57b-a14b", "q4_k")
    ds = decode_shape(sh, slots_for(sh, sh.layers, "12GiB", None))
    cost = CostModel.from_profile(H100, sh.expert)
    ev = Evidence(0.8, "run", 4096)
    plain = choose(ds, H100, cost, ev)
    assert plain.ncmoe_s / plain.promoe_s >= MARGIN  # decode alone would take the cache
    assert plain.prompt_ratio() is not None and plain.prompt_ratio() < 1.0
    assert plain.policy == "ncmoe" and "the prompt decides" in plain.reason()
    assert "without prompt banks" in plain.reason()
    banked = choose(replace(ds, bank=True), H100, cost, ev)
    assert banked.prompt_ratio() > 1.0 and banked.policy == "promoe"
    assert "the prompt decides" not in banked.reason()
    # the default weighs the banked placement second (fewer slots: the banks' memory)
    fewer = replace(ds, bank=True, n_slots=ds.n_slots - 4)
    got = choose_among([(ds, ev), (fewer, ev)], H100, cost)
    assert got.policy == "promoe" and got.alternative and got.shape == fewer
    assert "beyond their default share" in got.reason()
    first = choose_among([(fewer, ev), (ds, ev)], H100, cost)
    assert first.shape == fewer and not first.alternative
    none = choose_among([(ds, PRIOR), (fewer, PRIOR)], H100, cost)  # uniform: stock's
    assert none.policy == "ncmoe" and none.shape == ds and not none.alternative
    # a ubatch under llama.cpp's offload rule is decode's question: no prompt estimate
    short = choose(replace(ds, prompt_rows=16), H100, cost, ev)
    assert short.prompt_ratio() is None and short.policy == "promoe"
    # more rows route more experts, never more than a layer has
    assert distinct_experts(1, 64, 8) == pytest.approx(8) and distinct_experts(4096, 64, 8) <= 64
    assert distinct_experts(16, 64, 8) < distinct_experts(64, 64, 8) < 64


@pytest.mark.parametrize("budget", ["16GiB", "24GiB"])
def test_prompt_estimates_agree_with_the_simulator(budget: str) -> None:
    """A 512-token prompt at the target: ncmoe's and promoe's (with prompt banks) estimates are
    the simulator's within 10%, and so their ratio within 15%."""
    sh = shape_of("qwen2-57b-a14b", "q4_k")
    n = slots_for(sh, sh.layers, budget, None)
    reqs = synth.synthesize(synth.OLMOE_FIT, n_layers=sh.layers, n_expert=sh.experts,
                            top_k=sh.top_k, tokens=[514], prefill=[512], seed=0)
    sim = {p: run_one(reqs, sh, H100, SimConfig(p, n), None) for p in ("ncmoe", "promoe")}
    assert sim["promoe"].extra["banked_layers"] > 0
    # the slots the banks leave: a layer's bank holds what they lack
    lack = sim["promoe"].extra["bank_bytes"] / sh.expert_bytes / sh.layers
    ds = replace(decode_shape(sh, n), bank=True, n_slots=round(sh.experts - lack))
    cost = CostModel.from_profile(H100, sh.expert)
    nc, pm = ncmoe_prompt_s(ds, H100, cost), promoe_prompt_s(ds, H100, cost)
    assert nc == pytest.approx(sim["ncmoe"].ttft_s, rel=0.10)
    assert pm == pytest.approx(sim["promoe"].ttft_s, rel=0.10)
    assert nc / pm == pytest.approx(sim["ncmoe"].ttft_s / sim["promoe"].ttft_s, rel=0.15)


def test_bench_reports_the_default_with_its_reason(tiny_model: Callable[..., Path]) -> None:
    """``forecache bench``'s default row is what a run without --policy gets: the chosen
    policy's run in the same call, with the choice's reason; named alone, it runs itself."""
    from forecache.bench import DEFAULT_RUN, format_table, run_bench

    model = tiny_model("q8_0")
    both = run_bench(model, [DEFAULT_RUN, "promoe"], gpu_budget=None, cache_fraction=0.5,
                     prompt_len=24, n_gen=4, n_prompts=1, n_threads=2)
    rows = {r["policy"]: r for r in both["results"]}
    assert set(rows) == {"promoe", DEFAULT_RUN} and not both["errors"]
    d = rows[DEFAULT_RUN]
    # a cache sized by a fraction has nothing to choose from (ncmoe needs a budget)
    assert d["chosen"]["policy"] == "promoe" and "nothing to choose" in d["chosen"]["reason"]
    assert d["ttft_s"] == rows["promoe"]["ttft_s"] and d["tpot_s"] == rows["promoe"]["tpot_s"]
    assert both["same_tokens"]
    assert f"{DEFAULT_RUN} (no --policy): policy promoe" in format_table(both)
    alone = run_bench(model, [DEFAULT_RUN], gpu_budget=None, cache_fraction=0.5,
                      prompt_len=24, n_gen=4, n_prompts=1, n_threads=2)
    (r,) = alone["results"]
    assert r["policy"] == DEFAULT_RUN and r["chosen"]["policy"] == "promoe" and r["tpot_s"] > 0
