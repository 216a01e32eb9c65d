"""The hot path's counters (forecache_cache_stats): what a pass costs the host beside the
products themselves: stops, blocking transfers, mini graphs. Counted, not timed: they hold on
every CPU."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from forecache.cache.timeline import summarize
from forecache.generate import SamplingParams, generate, last_logits, text_tokens
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.placement.options import CacheConfig
from tests.conftest import assert_same_tokens

if TYPE_CHECKING:
    from conftest import StockReference

HOST_WORK = ("stops", "readbacks", "uploads", "mini_graphs", "copy_waits")


def _n_proj(model: Path) -> int:
    """Routed-expert projections of a MoE layer (gate, up, down)."""
    mf = read_model_file(model)
    il = mf.moe_layers()[0]
    return sum(1 for t in mf.tensors if t.name.startswith(f"blk.{il}.") and "_exps" in t.name)


def _passes(llm: Llama) -> int:
    cache = llm.expert_cache
    assert cache is not None
    return cache.passes(next(iter(cache.layers)))[0]


def _decode_passes(llm: Llama, n: int) -> list[dict[int, dict]]:
    """Per-layer counters of each of ``n`` one-token passes after the current context."""
    cache = llm.expert_cache
    assert cache is not None
    out = []
    token = 1
    for _ in range(n):
        before = {il: cache.stats(il) for il in cache.layers}
        llm.eval([token])
        after = {il: cache.stats(il) for il in cache.layers}
        out.append({il: {k: after[il][k] - before[il][k] for k in after[il]
                         if isinstance(after[il][k], int)} for il in cache.layers})
        token = int(np.argmax(last_logits(llm)))
    return out


def test_every_expert_resident_runs_as_stock(tiny_model: Callable[[str], Path]) -> None:
    """With every expert in a slot, no layer stops: no routing read back, no slot ids written,
    no graph of the cache's own; each projection is one product over the slots."""
    model = tiny_model("q8_0")
    n_proj = _n_proj(model)
    with Llama.open(model, n_ctx=512, n_batch=128, n_threads=2,
                    cache=CacheConfig("static", cache_fraction=1.0)) as llm:
        cache = llm.expert_cache
        assert cache is not None
        cache.wait_idle()  # the pinned experts' copies
        prompt = text_tokens(llm, "The quick brown fox jumps over the lazy dog. " * 20)[:200]
        assert len(prompt) == 200
        llm.eval([1])  # the first pass writes each layer's map once
        llm.reset()
        llm.reset_stats()
        first = _passes(llm)
        llm.eval(prompt)  # two ubatches
        for _ in range(6):
            llm.eval([int(np.argmax(last_logits(llm)))])
        passes = _passes(llm) - first
        s = llm.expert_cache.stats()
        layers = len(cache.layers)
        assert passes == 2 + 6
        assert {k: s[k] for k in HOST_WORK} == dict.fromkeys(HOST_WORK, 0), s
        assert s["quiet"] == layers * passes
        assert s["products"] == n_proj * layers * passes
        assert s["hook_calls"] == 0 and s["misses"] == 0 and s["host_layers"] == 0
        # a one-row routing's top-k are all hits: each decoded token's, and the last layer of
        # each prompt pass, which computes its output row only (a prompt's distinct experts are
        # not known)
        n_used = read_model_file(model).n_expert_used
        assert s["hits"] == n_used * (layers * 6 + 2)


def test_a_decode_pass_stops_once_a_layer(tiny_model: Callable[[str], Path]) -> None:
    """A layer that must read its routing (not every expert resident) stops once, before its
    first product, in a one-token pass: its routed experts' slots go into its map on the device,
    and each projection of a miss is copied and waited for on the host while the nodes before it
    run (no stop), then every projection is one product: no graph of the cache's own."""
    model = tiny_model("q8_0")
    n_proj = _n_proj(model)
    n_expert = read_model_file(model).n_expert
    with Llama.open(model, n_ctx=512, n_batch=128, n_threads=2,
                    cache=CacheConfig("lru", slots_per_layer=n_expert - 2)) as llm:
        prompt = text_tokens(llm, "The quick brown fox jumps over the lazy dog. " * 6)
        generate(llm, prompt, 4, SamplingParams(greedy=True), ignore_eos=True)
        assert llm.expert_cache is not None
        # a CPU has no events: no copy stream, each chunk copied synchronously by the worker
        assert llm.expert_cache.copy_streams == 0
        llm.expert_cache.wait_idle()
        seen = {"hit": 0, "miss": 0}
        for per_layer in _decode_passes(llm, 16):
            for il, d in per_layer.items():
                assert d["quiet"] == 0  # two experts of each layer are never resident
                assert d["host_layers"] == 0  # a token's top-k always fits the slots
                assert d["stops"] == 1 and d["mini_graphs"] == 0, (il, d)
                assert d["products"] == n_proj, (il, d)
                # the routed ids; the router weights only for a gate the hook decides
                assert d["readbacks"] == 1 + (d["hook_calls"] > 0), (il, d)
                assert d["uploads"] <= 1 and d["copy_waits"] <= n_proj, (il, d)
                assert d["event_waits"] == 0, (il, d)
                if d["misses"]:
                    seen["miss"] += 1
                else:
                    seen["hit"] += 1
                    assert d["copy_waits"] == 0, (il, d)
        assert seen["hit"] and seen["miss"], seen  # both kinds of layer were seen


def _slow_bus(tmp_path: Path) -> str:
    """A machine whose copies are slower than its CPU's expert compute: a decoded token's missing
    experts go to the host, its resident ones stay on the device."""
    raw = json.loads((Path(__file__).parents[1] / "forecache" / "data" / "profiles" /
                      "rtx4090.json").read_text())
    path = tmp_path / "slow-bus.json"
    path.write_text(json.dumps(dict(raw, name="slow-bus", h2d_gbps=0.01, cpu_mem_gbps=0.1)))
    return str(path)


@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek2"])
def test_host_experts_are_computed_whole(preset: str, tiny_model: Callable[..., Path],
                                         tmp_path: Path, stock: StockReference) -> None:
    """A decoded layer split between slots and host experts hands its host experts to the CPU
    once, every projection computed there in one graph, while each projection runs as one
    product over the slots; their rows are written into the last product's result on the
    stream: one stop a layer, no expert group, no scatter. A layer computed wholly on the host
    stops once and skips its products. Greedy tokens and logits equal the unpatched build's."""
    model = tiny_model("q8_0", preset)
    n_proj = _n_proj(model)
    # (no stage slots or prompt banks, which a GPU would otherwise place: decode is under test)
    cfg = CacheConfig("promoe", cache_fraction=0.25, predictor="history",
                      machine=_slow_bus(tmp_path), stage_slots=0, prompt_bank=False)
    with Llama.open(model, n_ctx=512, n_batch=128, n_threads=2, cache=cfg) as llm:
        prompt = text_tokens(llm, "The quick brown fox jumps over the lazy dog. " * 6)
        generate(llm, prompt, 4, SamplingParams(greedy=True), ignore_eos=True)
        assert llm.expert_cache is not None
        llm.expert_cache.wait_idle()
        seen = {"split": 0, "host": 0}
        fast = 0  # gates decided in C
        for per_layer in _decode_passes(llm, 12):
            for il, d in per_layer.items():
                if d["quiet"]:
                    continue
                assert d["stops"] == 1 and d["n_groups"] == 0, (il, d)
                # read back: the routed ids, the layer's input when its host experts are
                # computed whole, the router weights only for a gate the hook decides
                assert d["readbacks"] == 1 + d["whole"] + (d["hook_calls"] > 0), (il, d)
                fast += d["decode_gates"]
                if d["host_layers"]:
                    seen["host"] += 1
                    assert d["whole"] == 1 and d["products"] == 0, (il, d)
                    assert d["mini_graphs"] == 1, (il, d)
                elif d["host_entries"]:
                    seen["split"] += 1
                    assert d["whole"] == 1 and d["products"] == n_proj, (il, d)
                    assert d["mini_graphs"] == 1, (il, d)  # the CPU's graph only
                else:
                    assert d["whole"] == 0 and d["mini_graphs"] == 0, (il, d)
        assert seen["split"] > 0 and fast > 0, (seen, fast)
        llm.reset()
        res = generate(llm, prompt, 16, SamplingParams(greedy=True), ignore_eos=True)
        logits = last_logits(llm)
        assert llm.expert_cache.stats()["whole"] > 0
    ref_tokens, ref_logits = stock.run(model, [prompt], 16, n_ctx=512, n_batch=128,
                                       n_threads=2)[0]
    if stock.backend != "cpu":  # the GPU check: equal up to rounding
        assert_same_tokens(res.tokens, ref_tokens, ref_logits, f"whole {preset}")
        return
    assert res.tokens == ref_tokens
    assert np.array_equal(logits, ref_logits[-1])


def test_layers_are_stopped_for_a_route_listener(tiny_model: Callable[[str], Path]) -> None:
    """A caller that watches every routing (``on_route``) sees resident layers too."""
    model = tiny_model("q8_0")
    seen: list[int] = []
    cfg = CacheConfig("static", cache_fraction=1.0,
                      on_route=lambda layer, ids, _w, _x: seen.append(layer))
    with Llama.open(model, n_ctx=256, n_threads=2, cache=cfg) as llm:
        assert llm.expert_cache is not None
        llm.expert_cache.wait_idle()
        generate(llm, [1, 2, 3], 4, SamplingParams(greedy=True), ignore_eos=True)
        s = llm.expert_cache.stats()
        layers = len(llm.expert_cache.layers)
    assert s["quiet"] == 0
    assert len(seen) == s["stops"] and len(seen) % layers == 0 and seen


def _ready(llm: Llama) -> dict[int, list[int]]:
    """Each cached layer's slot contents, -1 where a slot is empty or its copy is not done."""
    cache = llm.expert_cache
    assert cache is not None
    out = {}
    for il in cache.layers:
        experts, states = cache.layer_state(il)
        out[il] = [int(e) if st == 0 else -1 for e, st in zip(experts, states, strict=True)]
    return out


def test_a_prompt_ubatch_reads_no_routing(tiny_model: Callable[[str], Path]) -> None:
    """With prompt banks, a ubatch of 32 rows or more reads no routed id back and computes each
    projection as one product over the layer's slots and its bank: only the experts the slots
    lack are copied (into the bank, or into an empty slot while there is one); no resident
    expert leaves its slot, and the next decoded token routes from the same slots again."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    n_proj = _n_proj(model)
    n_slots = mf.n_expert - 2
    cfg = CacheConfig("lru", slots_per_layer=n_slots, prompt_bank=True)
    with Llama.open(model, n_ctx=512, n_batch=128, n_threads=2, cache=cfg) as llm:
        cache = llm.expert_cache
        assert cache is not None and cache.bank_tokens == 32
        short = text_tokens(llm, "The quick brown fox jumps over the lazy dog. " * 2)[:4]
        generate(llm, short, 2, SamplingParams(greedy=True), ignore_eos=True)  # some slots
        cache.wait_idle()
        held = _ready(llm)
        assert any(e >= 0 for slots in held.values() for e in slots)
        assert any(e < 0 for slots in held.values() for e in slots)  # and empty ones
        prompt = text_tokens(llm, "Pack my box with five dozen liquor jugs. " * 20)[:200]
        assert len(prompt) == 200
        llm.reset()
        llm.reset_stats()
        first = _passes(llm)
        cache.start_timeline()
        llm.eval(prompt)  # two ubatches: 128 and 72 rows
        passes = _passes(llm) - first
        assert passes == 2
        spans, _ = cache.timeline()
        fills = [s for s in spans if s.kind == "bank"]
        assert sorted({s.n for s in fills}) == [72, 128]  # each fill names its ubatch's rows
        tl = summarize(spans)
        assert set(tl["phases"]) == {"prefill"} and tl["phases"]["prefill"]["passes"] == 2
        assert tl["phases"]["prefill"]["kinds"]["bank"]["n"] == len(fills) > 0
        after = _ready(llm)
        last = max(cache.layers)
        for il, info in cache.layers.items():
            s = cache.stats(il)
            if il == last:  # computes the output row only: one row, routed as in decode
                assert s["banked"] == 0 and s["stops"] >= passes, (il, s)
                continue
            # the resident experts stayed; the empty slots took the first pass's misses
            assert all(b < 0 or a == b for a, b in zip(after[il], held[il], strict=True)), il
            assert all(a >= 0 for a in after[il]), (il, after[il])
            assert s["readbacks"] == 0 and s["mini_graphs"] == 0, (il, s)
            assert s["hook_calls"] == 0 and s["host_layers"] == 0, (il, s)
            assert s["banked"] == passes and s["products"] == n_proj * passes, (il, s)
            assert s["stops"] == passes, (il, s)  # a CPU has no events: the fills' thread
            assert s["uploads"] <= n_proj * passes, (il, s)  # the tables, where they changed
            resident = sum(e >= 0 for e in held[il])
            copied = (info.n_expert - resident) + (info.n_expert - n_slots)
            assert s["bank_bytes"] == copied * info.expert_bytes, (il, s)
        # decode reads its routing again, from the slots
        llm.reset_stats()
        llm.eval([int(np.argmax(last_logits(llm)))])
        s = cache.stats()
        assert s["banked"] == 0 and s["stops"] >= len(cache.layers) and s["hits"] > 0
        assert s["readbacks"] >= len(cache.layers)


def test_prompt_banks_come_before_any_load(tiny_model: Callable[[str], Path]) -> None:
    """The banks place the slots anew behind their regions: asked for once experts are in the
    slots, they are refused in one line, and the cache goes on as it was."""
    import ctypes

    model = tiny_model("q8_0")
    with Llama.open(model, n_ctx=256, n_threads=2,
                    cache=CacheConfig("static", cache_fraction=0.5)) as llm:
        cache = llm.expert_cache
        assert cache is not None and cache.bank_tokens == 0  # not asked for on a CPU build
        cache.wait_idle()
        err = ctypes.create_string_buffer(256)
        assert cache._api.cache_set_bank(cache.handle, 32, err, len(err)) == -1
        assert err.value.decode() == "prompt banks must be set before any expert is loaded"
        res = generate(llm, [1, 2, 3], 4, SamplingParams(greedy=True), ignore_eos=True)
        assert len(res.tokens) == 4 and llm.expert_cache.stats()["banked"] == 0


def test_prompt_banks_placement(tiny_model: Callable[[str], Path]) -> None:
    """On a GPU the banks take the stage slots' place: two regions of what the layer with the
    fewest slots lacks, settled with the slots they leave; none where nothing misses, where
    something watches every routing, or (by default) past a quarter of the expert budget."""
    from forecache.cache.budget import BANK_REGIONS, BudgetError, split_budget
    from forecache.cache.prefetcher import stage_slots
    from forecache.placement.before import bank_experts, held_back

    mf = read_model_file(tiny_model("q8_0"))
    layers = mf.moe_layers()
    expert = max(mf.layer_expert_bytes())

    def plan(n_experts: float):  # type: ignore[no-untyped-def]
        base = split_budget(mf, 1 << 40, n_ctx=512, n_ubatch=128, device_name="gpu",
                           device_total=1 << 50)
        return split_budget(mf, base.fixed_bytes + int(n_experts * expert), n_ctx=512,
                           n_ubatch=128, device_name="gpu", device_total=1 << 50)

    def held(p, policy: str = "promoe", **kw):  # type: ignore[no-untyped-def]
        cfg = CacheConfig(policy, gpu_budget=p.budget, **kw)
        return held_back(mf, cfg, p, p.slots_per_layer(), "cuda", proactive=True)

    big = plan(len(layers) * mf.n_expert * 0.9)  # most experts fit
    stage, bank = held(big)
    slots = big.slots_per_layer(held=bank)
    assert stage == 0 and bank == bank_experts(mf, slots) > 0
    assert bank == BANK_REGIONS * (mf.n_expert - min(slots[il] for il in layers))
    assert held(big, prompt_bank=False) == \
        (stage_slots(mf.n_expert, big.slots_per_layer(), streams=True), 0)
    assert held(big, "infinity")[1] == 0  # its EAM reads every routing
    assert held(plan(len(layers) * mf.n_expert * 1.5)) == (0, 0)  # every expert fits
    small = plan(len(layers) * mf.n_expert * 0.3)
    assert held(small)[1] == 0  # the banks would take most of the slots
    medium = plan(len(layers) * mf.n_expert * 0.6)
    assert held(medium)[1] == 0 and held(medium, prompt_bank=True)[1] > 0  # asked for: placed
    with pytest.raises(BudgetError, match="prompt banks of .* leave no expert slots"):
        held(small, prompt_bank=True)


def _restart_when_banked(cache, banks: int, seen: dict) -> None:  # type: ignore[no-untyped-def]
    """Restarts the stopped copy worker once ``banks`` layer passes came from their banks (or a
    minute on)."""
    from forecache.native.testing import controls

    deadline = time.monotonic() + 60  # a prompt that waits for the stopped worker fails
    while cache.stats()["banked"] < banks and time.monotonic() < deadline:
        time.sleep(0.001)
    seen.update(cache.stats())
    controls().cache_pause(cache.handle, False)


def test_a_prompt_takes_the_place_of_queued_loads(tiny_model: Callable[[str], Path]) -> None:
    """Loads still queued into a bank layer's slots when a prompt begins give way to its bank
    fill (which copies those experts itself), so the prompt never waits on copies that cannot
    run: with the copy worker stopped, every slot's load queued, the prompt still runs and
    computes what it computes without banks."""
    from forecache.native.testing import controls

    model = tiny_model("q8_0")
    n_slots = read_model_file(model).n_expert - 2
    prompt: list[int] = []
    logits = {}
    for bank in (False, True):
        cfg = CacheConfig("lru", slots_per_layer=n_slots, prompt_bank=bank)
        with Llama.open(model, n_ctx=256, n_batch=128, n_threads=2, cache=cfg) as llm:
            cache = llm.expert_cache
            assert cache is not None
            prompt = prompt or text_tokens(llm, "Sphinx of black quartz, judge my vow. " * 8)[:64]
            ctl = controls()
            ctl.cache_pause(cache.handle, True)
            for il in cache.layers:
                for s in range(n_slots):
                    assert cache.load(il, s, s, 1) >= 0
            if bank:
                # the last layer computes the output row alone, routed as in decode: its misses
                # need the worker, restarted once every bank layer has computed
                banks = len(cache.layers) - 1
                seen: dict[str, int] = {}
                t = threading.Thread(target=_restart_when_banked, args=(cache, banks, seen))
                t.start()
                llm.eval(prompt)
                t.join()
                assert seen["banked"] == banks and seen["dropped_chunks"] > 0, seen
            else:
                ctl.cache_pause(cache.handle, False)
                llm.eval(prompt)
            logits[bank] = last_logits(llm).copy()
    assert np.array_equal(logits[False], logits[True])


def test_bench_splits_the_host_work_by_phase(tiny_model: Callable[[str], Path]) -> None:
    """``forecache bench`` reports the host work a pass of each phase: a prompt pass from the
    prompt banks (no read-back but the last layer's one output row), decode passes routed."""
    from forecache.bench import run_policy

    model = tiny_model("q8_0")
    mf = read_model_file(model)
    cfg = CacheConfig("lru", slots_per_layer=mf.n_expert - 2, prompt_bank=True)
    with Llama.open(model, n_ctx=256, n_threads=2, cache=None) as llm:
        prompt = text_tokens(llm, "How vexingly quick daft zebras jump. " * 10)[:64]
    r = run_policy(model, cfg, [prompt], 6, n_ctx=256, n_threads=2)
    h = r["hot_path"]
    pre, dec = h["phases"]["prefill"], h["phases"]["decode"]
    assert pre["passes"] == 1 and dec["passes"] >= 4
    assert pre["passes"] + dec["passes"] == h["passes"]
    layers = len(mf.moe_layers())
    # every layer but the last (its one output row is routed as in decode) from its bank
    assert pre["banked"] == layers - 1 and pre["readbacks"] < dec["readbacks"]
    assert dec["banked"] == 0 and dec["stops"] >= layers and dec["readbacks"] >= layers
