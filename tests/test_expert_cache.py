"""The expert cache on the CPU build: lossless for every policy and size, accounting, copies."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from forecache.cache.budget import BudgetError, device_slots, split_budget
from forecache.generate import SamplingParams, generate, last_logits, text_tokens
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.native import api
from forecache.native.testing import controls
from forecache.placement.options import CacheConfig, spread_budget

if TYPE_CHECKING:
    from conftest import StockReference

N_GEN = 64
N_BATCH = 128  # the 300-token prompt spans three ubatches
PROMPT_LENS = (1, 7, 64, 300)


def _prompts(llm: Llama) -> list[list[int]]:
    text = text_tokens(llm, "The quick brown fox jumps over the lazy dog, again and again. "
                       * 40)
    return [text[:n] for n in PROMPT_LENS]


def _run(model: Path, cfg: CacheConfig | None) -> list[tuple[list[int], np.ndarray, dict]]:
    with Llama.open(model, n_ctx=512, n_batch=N_BATCH, n_threads=2, cache=cfg) as llm:
        out = []
        for p in _prompts(llm):
            res = generate(llm, p, N_GEN, SamplingParams(greedy=True), ignore_eos=True)
            out.append((res.tokens, last_logits(llm), res.stats))
        return out


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], Path], stock: StockReference,
              ) -> list[tuple[list[int], np.ndarray, dict]]:
    """The unpatched llama-cpp-python, loaded as the policies load (no weight repacking)."""
    model = tiny_model("q8_0")
    with Llama.open(model, n_ctx=512, n_threads=2, cache=CacheConfig("offload")) as llm:
        prompts = _prompts(llm)
    runs = stock.run(model, prompts, N_GEN, n_ctx=512, n_batch=N_BATCH, n_threads=2)
    return [(tokens, logits[-1], {}) for tokens, logits in runs]


def _ncmoe_budget(model: Path, host_layers: int) -> int:
    mf = read_model_file(model)
    plan = split_budget(mf, 1 << 40, n_ctx=512, n_ubatch=N_BATCH, device_name="x",
                       device_total=1 << 50)
    return plan.ncmoe_budget(host_layers)


def _configs(model: Path) -> list[CacheConfig]:
    cfgs = [CacheConfig("offload"),
            CacheConfig("ncmoe", gpu_budget=_ncmoe_budget(model, 2))]
    for pol in ("lru", "static"):
        cfgs.append(CacheConfig(pol, slots_per_layer=1))
        cfgs += [CacheConfig(pol, cache_fraction=f) for f in (0.25, 0.5, 1.0)]
    # prompts of 64 and 300 tokens computed from prompt banks
    cfgs += [CacheConfig("lru", slots_per_layer=1, prompt_bank=True),
             CacheConfig("lru", cache_fraction=0.5, prompt_bank=True)]
    return cfgs


def test_every_policy_is_lossless(tiny_model: Callable[[str], Path], reference: list) -> None:
    model = tiny_model("q8_0")
    assert reference[0][1].shape == (read_model_file(model).n_vocab,)
    for cfg in _configs(model):
        got = _run(model, cfg)
        for n, (ref, out) in zip(PROMPT_LENS, zip(reference, got, strict=True), strict=True):
            where = (f"{cfg.policy} slots={cfg.slots_per_layer} "
                     f"fraction={cfg.cache_fraction} bank={cfg.prompt_bank} prompt={n}")
            assert out[0] == ref[0], f"tokens differ: {where}"
            assert np.array_equal(out[1], ref[1]), f"final logits differ: {where}"
        total = got[-1][2]
        assert (total.get("banked", 0) > 0) == bool(cfg.prompt_bank), cfg
        if cfg.prompt_bank:
            continue
        if cfg.cache_fraction is not None:
            # the cache was used: some layers ran from slots, with copies behind them (static
            # with a slot for every expert pins them all before the first token)
            assert total["cache_slots"] > 0 and total["hits"] > 0, cfg
            pinned_all = cfg.policy == "static" and cfg.cache_fraction == 1.0
            assert (total["h2d_bytes"] > 0) != pinned_all, cfg
        elif cfg.slots_per_layer == 1:
            # one slot cannot hold a top-4 token: every layer ran from host memory
            assert total["host_layers"] > 0 and total["h2d_bytes"] == 0, cfg


def _reference_lru(routes: list[tuple[int, np.ndarray]], n_slots: int) -> dict:
    """Replay routed ids through an independent per-layer LRU of n_slots."""
    lru: dict[int, OrderedDict[int, None]] = {}
    hits = misses = loads = host = 0
    for layer, ids in routes:
        cache = lru.setdefault(layer, OrderedDict())
        want = list(dict.fromkeys(int(e) for e in ids.ravel()))
        present = [e for e in want if e in cache]
        hits += len(present)
        misses += len(want) - len(present)
        for e in present:
            cache.move_to_end(e)
        if len(want) > n_slots:
            host += 1
            continue
        for e in want:
            if e not in cache:
                if len(cache) == n_slots:
                    cache.popitem(last=False)
                cache[e] = None
                loads += 1
    return {"hits": hits, "misses": misses, "loads": loads, "host_layers": host}


def test_accounting_matches_reference_lru(tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("q8_0")
    n_slots = 6  # top-4 decode fits, prefill does not
    routes: list[tuple[int, np.ndarray]] = []
    cfg = CacheConfig("lru", slots_per_layer=n_slots,
                      on_route=lambda layer, ids, _w, _x: routes.append((layer, ids.copy())))
    with Llama.open(model, n_ctx=512, n_batch=N_BATCH, n_threads=2, cache=cfg) as llm:
        for p in _prompts(llm)[1:3]:
            generate(llm, p, 24, SamplingParams(greedy=True), ignore_eos=True)
        cache = llm.expert_cache
        assert cache is not None
        cache.wait_idle()
        stats = llm.expert_stats()
        expert_bytes = {il: info.expert_bytes for il, info in cache.layers.items()}
    assert len({layer for layer, _ in routes}) == read_model_file(model).n_layer
    ref = _reference_lru(routes, n_slots)
    assert ref["host_layers"] > 0 and ref["loads"] > 0  # both paths were exercised
    assert stats["hits"] == ref["hits"]
    assert stats["misses"] == ref["misses"]
    assert stats["host_layers"] == ref["host_layers"]
    assert len(set(expert_bytes.values())) == 1
    assert stats["h2d_bytes"] == ref["loads"] * next(iter(expert_bytes.values()))


def test_copy_engine_queue_and_cancel(tiny_model: Callable[[str], Path]) -> None:
    from forecache.cache.runtime import LOW

    model = tiny_model("q8_0")
    cfg = CacheConfig("lru", slots_per_layer=4, chunk_bytes=4096)
    with Llama.open(model, n_ctx=256, cache=cfg) as llm:
        cache = llm.expert_cache
        assert cache is not None
        fc, h = api(), cache.handle
        info = cache.layers[0]
        # queue more than the worker can finish at once, then cancel what has not started
        for il in cache.layers:
            for s in range(4):
                assert fc.cache_load(h, il, s + 4, s, LOW) == 0
        assert fc.cache_load(h, 0, info.n_expert, 0, LOW) == -1  # no such expert
        dropped = fc.cache_cancel(h, -1, LOW)
        cache.wait_idle()
        emptied = sum(cache.slot_of(il, s + 4) < 0 for il in cache.layers for s in range(4))
        assert emptied == dropped
        s = cache.stats()
        full = 16 - dropped  # loads that were not cancelled completed
        if dropped:  # a cancelled load may have copied some of its chunks, never all
            assert full * info.expert_bytes <= s["h2d_bytes"] < 16 * info.expert_bytes
        else:
            assert s["h2d_bytes"] == 16 * info.expert_bytes
        assert s["n_chunks"] >= full * -(-info.expert_bytes // 4096)
        # whatever survived still computes the same tokens as a fresh engine
        tokens = generate(llm, [1, 2, 3], 8, SamplingParams(greedy=True), ignore_eos=True).tokens
    with Llama.open(model, cache=None, n_ctx=256) as plain:
        assert generate(plain, [1, 2, 3], 8, SamplingParams(greedy=True),
                        ignore_eos=True).tokens == tokens


def test_repackable_type_runs_from_slots(tiny_model: Callable[[str], Path]) -> None:
    """q4_0 is a type llama.cpp's CPU backend repacks; host experts must keep the file layout."""
    model = tiny_model("q4_0")
    offload = _run(model, CacheConfig("offload"))
    lru = _run(model, CacheConfig("lru", cache_fraction=0.5))
    for a, b in zip(offload, lru, strict=True):
        assert a[0] == b[0] and np.array_equal(a[1], b[1])
    assert lru[-1][2]["hits"] > 0


def test_expert_matmul_control(tiny_model: Callable[[str], Path]) -> None:
    """The benchmark control that times host expert matmuls from the file's layout and from a
    repacked copy: both run (or the CPU has no repacked kernel), bad arguments are refused."""
    with Llama.open(tiny_model("q8_0"), n_ctx=256,
                    cache=CacheConfig("lru", slots_per_layer=2)) as llm:
        cache = llm.expert_cache
        assert cache is not None
        il, h, matmul_s = min(cache.layers), cache.handle, controls().cache_expert_matmul
        assert matmul_s(h, il, 0, 4, 2, False, 1, 3) > 0
        rep = matmul_s(h, il, 2, 1, 2, True, 2, 3)
        assert rep > 0 or rep == -2
        assert matmul_s(h, il, 3, 4, 2, False, 1, 3) == -1  # qwen2moe: 3 projections
        assert matmul_s(h, il, 0, 0, 2, False, 1, 3) == -1
        assert matmul_s(h, 99, 0, 4, 2, False, 1, 3) == -1


def test_host_thread_handoff(tiny_model: Callable[[str], Path]) -> None:
    """The kept host-entry thread takes jobs before and between generations and is stopped with
    the cache; the same control times a thread started per job, as the benchmark compares."""
    model = tiny_model("q8_0")
    with Llama.open(model, n_ctx=256, cache=CacheConfig("lru", slots_per_layer=2)) as llm:
        cache = llm.expert_cache
        assert cache is not None
        h, handoff_s = cache.handle, controls().cache_host_handoff
        assert handoff_s(h, 20, False) > 0 and handoff_s(h, 20, True) > 0
        tokens = generate(llm, [1, 2, 3], 8, SamplingParams(greedy=True), ignore_eos=True).tokens
        assert handoff_s(h, 5, False) > 0
    with Llama.open(model, cache=None, n_ctx=256) as plain:
        assert generate(plain, [1, 2, 3], 8, SamplingParams(greedy=True),
                        ignore_eos=True).tokens == tokens


@pytest.mark.parametrize("preset", ["tiny", "tiny-mixtral", "tiny-deepseek2"])
def test_compute_buffers_count_the_experts_width(tiny_model: Callable[..., Path],
                                                 preset: str) -> None:
    """Mixtral-style headers have no expert_feed_forward_length: the experts' rows are counted
    from their tensors' width all the same."""
    from forecache.cache.budget import compute_buffer_bytes
    from forecache.gguf.specs import get_spec

    spec = get_spec(preset)
    plan = split_budget(read_model_file(tiny_model("q8_0", preset)), 1 << 40, n_ctx=512,
                       n_ubatch=N_BATCH, device_name="x", device_total=1 << 50)
    assert plan.compute_bytes == compute_buffer_bytes(N_BATCH, spec.top_k, spec.expert_ff,
                                                      spec.d_model, spec.vocab)


def test_each_devices_budget_sizes_its_own_layers(tiny_model: Callable[..., Path]) -> None:
    """Layers split over two devices as llama.cpp splits them: each device's budget pays for its
    own layers' weights and buffers, the output head on the last layer's device, and its slots;
    one size is the devices' total, shared so that every layer gets the same slots; a count
    that fits neither or a budget without room for a slot is one line naming the fix or the
    device."""
    mf = read_model_file(tiny_model("q8_0"))
    moe, n = mf.moe_layers(), mf.n_layer
    half = n // 2
    split = [1] * half + [2] * (n - half)
    names = {1: "RPC0", 2: "RPC1"}
    per_layer = sum(mf.layer_expert_bytes()[:1])

    def slots(*budgets: int) -> tuple[int, int]:
        got = device_slots(mf, tuple(budgets), split, names, n_ctx=256, n_ubatch=N_BATCH)
        return got[moe[0]], got[moe[-1]]

    lo, hi = 0, 1 << 34  # the least budget for a slot a layer on both devices
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            slots(mid, mid)
            hi = mid
        except BudgetError:
            lo = mid
    base = hi + 4 * half * per_layer
    a, b = slots(base, base)
    assert 1 <= b <= a < mf.n_expert  # the second device also holds the output head
    # one size: the devices' total, each paying for what is not experts, and every layer the
    # same slots: those of the devices' budgets summed, split to even both
    assert slots(2 * base)[0] == slots(2 * base)[1] and b <= slots(2 * base)[0] <= a
    assert slots(2 * base + n * per_layer) == (slots(2 * base)[0] + 1,) * 2
    # a layer's expert more on the first device's budget for each of its layers: one slot more
    # a layer there, the second unchanged
    assert slots(base + half * per_layer, base) == (a + 1, b)
    assert slots(base, base + (n - half) * per_layer) == (a, b + 1)
    assert slots(1 << 40, base) == (mf.n_expert, b)
    with pytest.raises(BudgetError, match="3 sizes.*2 devices .RPC0, RPC1."):
        slots(base, base, base)
    with pytest.raises(BudgetError, match="on RPC1 is too small"):
        slots(base, 1 << 20)
    # a run over several devices takes a single size as their total
    one = spread_budget(CacheConfig("promoe", gpu_budget=base, stage_slots=4))
    assert (one.gpu_budget, one.device_budgets, one.stage_slots) == (None, (base,), 4)
    # each device's stage slots come out of its own budget: as many as the first device has
    # layers cost it one slot a layer (q8_0: every layer's experts the same size)
    assert len(set(mf.layer_expert_bytes())) == 1
    held = device_slots(mf, (base, base), split, names, n_ctx=256, n_ubatch=N_BATCH, held=half)
    assert held[moe[0]] == a - 1 and held[moe[-1]] <= b
    # a total pays for both devices' stage slots before it is shared
    both = device_slots(mf, (2 * base,), split, names, n_ctx=256, n_ubatch=N_BATCH, held=half)
    assert both[moe[0]] == both[moe[-1]] < slots(2 * base)[0]
    # ncmoe's host layers are fitted to each device's budget too (budget.device_host_layers)
    assert spread_budget(CacheConfig("ncmoe", gpu_budget=base)).device_budgets == (base,)
    assert spread_budget(CacheConfig("offload")).device_budgets is None
    frac = CacheConfig("lru", cache_fraction=0.5)
    assert spread_budget(frac) == frac


def test_budgets_follow_each_layers_expert_size(tiny_model: Callable[..., Path]) -> None:
    """A Q4_K_M file gives some layers' experts more bits (Q6_K ffn_down): slots fill the budget
    with each layer's own size, and ncmoe's host layers are the fewest that leave the rest in."""
    mf = read_model_file(tiny_model("q4_k_m"))
    sizes = mf.layer_expert_bytes()
    assert len(set(sizes)) == 2 and sizes[2] > sizes[0]  # layers 2 and 3: Q6_K ffn_down
    full = split_budget(mf, 1 << 40, n_ctx=512, n_ubatch=N_BATCH, device_name="x",
                       device_total=1 << 50)
    for extra in (sum(sizes) * 3 + sizes[0], sum(sizes) * 5 + sizes[0] + sizes[1] + 7):
        plan = split_budget(mf, full.fixed_bytes + extra, n_ctx=512, n_ubatch=N_BATCH,
                           device_name="x", device_total=1 << 50)
        slots = plan.slots_per_layer()
        used = sum(slots[il] * b for il, b in zip(mf.moe_layers(), sizes, strict=True))
        assert used <= plan.expert_budget
        # no layer short of its experts could take one more
        assert all(slots[il] == mf.n_expert or used + b > plan.expert_budget
                   for il, b in zip(mf.moe_layers(), sizes, strict=True))
    for host in range(len(sizes) + 1):
        budget = full.ncmoe_budget(host)
        plan = split_budget(mf, budget, n_ctx=512, n_ubatch=N_BATCH, device_name="x",
                           device_total=1 << 50)
        assert plan.ncmoe_cpu_layers() == host
        if host < len(sizes):  # a byte less moves one more layer to the host
            less = split_budget(mf, budget - 1, n_ctx=512, n_ubatch=N_BATCH, device_name="x",
                               device_total=1 << 50)
            assert less.ncmoe_cpu_layers() == host + 1
