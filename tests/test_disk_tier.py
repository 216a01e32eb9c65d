"""The disk tier: a host budget below the experts' bytes leaves them in the GGUF file, and the
cache reads them into host slots as copies and host compute need them. Lossless against the
unpatched build; the counters prove the experts came from the file with direct I/O, and the
kernel's page cache never held their pages."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from cli_helpers import run_cli, run_cli_json
from conftest import assert_same_greedy
from disk_helpers import cached_pages, direct_io, drop_cached, quarter_budget
from stock_runner import greedy

from forecache.cache.disk import host_weight_bytes, size_disk_tier
from forecache.gguf.header import ModelFile, read_model_file
from forecache.llama import Llama
from forecache.placement.options import CacheConfig

if TYPE_CHECKING:
    from conftest import StockReference

PARAMS = {"n_ctx": 2048, "n_batch": 1024, "n_ubatch": 256, "n_threads": 2}
TEXT = "The quick brown fox jumps over the lazy dog, again and again. "
N_GEN = 10
SLOT_FRACTION = 0.25


def _own_copy(model: Path, tmp_path: Path) -> Path:
    """A copy of ``model`` whose pages the kernel's page cache does not hold."""
    out = tmp_path / model.name
    shutil.copyfile(model, out)
    drop_cached(out)
    return out


def _expert_ranges(mf: ModelFile) -> list[tuple[int, int]]:
    return [(mf.data_offset + t.offset, mf.data_offset + t.offset + t.nbytes)
            for il in mf.moe_layers() for t in mf.expert_tensors(il)]


@pytest.mark.parametrize("policy", ["promoe", "lru"])
def test_experts_read_from_disk_equal_unpatched(policy: str, tiny_model: Callable[..., Path],
                                                stock: StockReference, tmp_path: Path) -> None:
    original = tiny_model("q4_k")
    model = _own_copy(original, tmp_path)  # the reference reads the original's pages
    mf = read_model_file(model)
    cfg = CacheConfig(policy, cache_fraction=SLOT_FRACTION,
                      host_budget=quarter_budget(mf, SLOT_FRACTION))
    with Llama(str(model), cache=cfg, verbose=False, **PARAMS) as llm:
        assert llm.placement is not None and llm.placement.disk is not None
        disk = llm.placement.disk
        assert set(n for n in disk.n_host if n) == {mf.n_expert // 4}
        # what loading the other weights read (and the kernel read ahead) leaves the page cache
        drop_cached(model)
        text = llm.tokenize((TEXT * 80).encode())
        prompts = [text[:1], text[:300], text[:700]]
        ref = stock.run(original, prompts, N_GEN, **PARAMS)
        for p, (ref_tokens, ref_logits) in zip(prompts, ref, strict=True):
            tokens, logits = greedy(llm, p, N_GEN)
            assert_same_greedy(tokens, logits, ref_tokens, ref_logits,
                               f"disk tier {policy} prompt={len(p)}", stock.backend == "cpu")
        stats = llm.expert_cache.stats()
        host_state = [llm.expert_cache.host_state(il) for il in mf.moe_layers()]
    per = max(mf.layer_expert_bytes())
    assert stats["disk_reads"] > len(mf.moe_layers()) * mf.n_expert // 4, stats
    assert stats["disk_bytes"] == stats["disk_reads"] * per
    assert stats["host_misses"] > 0 and stats["host_hits"] > 0
    assert stats["host_evictions"] > 0  # a quarter of the experts cannot hold a 700-token prompt's
    for experts, ready in host_state:
        held = experts[experts >= 0]
        assert len(held) == len(set(held.tolist())) and ready[experts >= 0].all()
    if direct_io(model):
        assert stats["disk_direct_bytes"] == stats["disk_bytes"]
    # the experts came from the cache's own reads: the page cache holds none of their pages
    assert cached_pages(model, _expert_ranges(mf)) == 0


def test_host_budget_below_the_non_expert_weights_is_one_clear_error(
        tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("q4_k")
    mf = read_model_file(model)
    with pytest.raises(ValueError, match="host_budget=.*raise it to at least") as err:
        Llama(str(model), policy="lru", cache_fraction=SLOT_FRACTION,
              host_budget=host_weight_bytes(mf, on_gpu=False) // 2, verbose=False, **PARAMS)
    assert "\n" not in str(err.value)


def test_stock_placements_refuse_a_host_budget(tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="host_budget=.*policy ncmoe reads every expert"):
        CacheConfig("ncmoe", gpu_budget=1 << 30, host_budget=1 << 30)


def test_a_budget_that_holds_every_expert_needs_no_disk(tiny_model: Callable[..., Path]) -> None:
    mf = read_model_file(tiny_model("q4_k"))
    roomy = host_weight_bytes(mf, on_gpu=False) + mf.total_expert_bytes()
    assert size_disk_tier(mf, roomy, on_gpu=False) is None
    plan = size_disk_tier(mf, roomy - 1, on_gpu=False)
    assert plan is not None and plan.disk_expert_bytes > 0
    assert plan.host_expert_bytes + plan.disk_expert_bytes == mf.total_expert_bytes()


def test_host_slots_grow_with_the_budget(tiny_model: Callable[..., Path]) -> None:
    mf = read_model_file(tiny_model("q4_k"))
    base = host_weight_bytes(mf, on_gpu=False)
    per = max(mf.layer_expert_bytes()) * len(mf.moe_layers())
    counts = [size_disk_tier(mf, base + k * per, on_gpu=False).n_host[mf.moe_layers()[0]]
              for k in (mf.n_expert_used, 8, 12)]
    assert counts == [mf.n_expert_used, 8, 12]
    assert np.all(np.diff(counts) > 0)


def test_run_says_where_the_experts_live_and_what_the_disk_costs(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = _own_copy(tiny_model("q4_k"), tmp_path)
    budget = quarter_budget(read_model_file(model), SLOT_FRACTION)
    res = run_cli("run", "-m", str(model), "-n", "8", "--policy", "lru", "--cache-fraction",
                  str(SLOT_FRACTION), "--host-budget", str(budget), check=True)
    assert "disk tier:" in res.stderr and "read from the file (" in res.stderr
    assert re.search(r"disk tier: the file reads at [0-9.]+ GB/s with \d+ reads in flight",
                     res.stderr), res.stderr
    assert re.search(r"\[disk: [0-9.]+ experts \(.+\) read a token", res.stderr), res.stderr
    out = run_cli_json("generate", "-m", str(model), "-p", "hello", "-n", "4", "--greedy",
                       "--policy", "lru", "--cache-fraction", str(SLOT_FRACTION),
                       "--host-budget", str(budget))
    assert out["stats"]["disk_reads"] > 0 and out["stats"]["disk_bytes"] > 0


def test_a_host_budget_that_holds_every_expert_says_so(tiny_model: Callable[..., Path]) -> None:
    res = run_cli("run", "-m", str(tiny_model("q4_k")), "-n", "2", "--policy", "lru",
                  "--cache-fraction", str(SLOT_FRACTION), "--host-budget", "64GiB", check=True)
    assert "disk tier: off, 64.0 GiB of host memory holds every expert" in res.stderr, res.stderr
    assert "[disk:" not in res.stderr


def test_a_host_budget_too_small_is_one_line_from_the_cli(tiny_model: Callable[..., Path]) -> None:
    res = run_cli("run", "-m", str(tiny_model("q4_k")), "-n", "2", "--policy", "lru",
                  "--cache-fraction", str(SLOT_FRACTION), "--host-budget", "1MiB")
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--host-budget 1.0 MiB is below" in lines[0], res.stderr


def test_disk_reads_match_the_simulator(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """The runtime's reads from the file against the simulator's replay of the same routing
    (``sim.disk_reads``): within 15%, counting the device slots' first fill. A reactive policy,
    whose reads follow from the routing alone (promoe's prefetches depend on timing: its
    figures are in BENCHMARKS.md)."""
    policy = "lru"
    from forecache.generate import SamplingParams, generate
    from forecache.jobs.requests import Request as JobRequest
    from forecache.record import record_trace
    from forecache.sim.disk_reads import predict_disk_reads
    from forecache.sim.shapes import model_shape
    from forecache.trace.format import TraceFile

    model = _own_copy(tiny_model("q8_0"), tmp_path)
    mf = read_model_file(model)
    prompt, n_gen = TEXT * 6, 24
    cfg = CacheConfig(policy, cache_fraction=SLOT_FRACTION,
                      host_budget=quarter_budget(mf, SLOT_FRACTION), predictor="history")
    with Llama(str(model), cache=cfg, verbose=False, n_ctx=2048, n_batch=512, n_ubatch=512,
               n_threads=2) as llm:
        res = generate(llm, prompt, n_gen, SamplingParams(greedy=True), ignore_eos=True)
        measured = llm.expert_cache.stats()["disk_reads"]
        assert llm.placement is not None and llm.placement.disk is not None
        n_host = llm.placement.disk.n_host[mf.moe_layers()[0]]
        n_slots = llm.placement.n_slots
    trace = tmp_path / "routing.npz"
    record_trace(model, [JobRequest("r", 1, prompt=prompt)], trace, n_gen=n_gen, chat=False,
                 n_ctx=2048, n_batch=512)
    with TraceFile(trace) as tf:
        reqs = list(tf.requests(gate_input=False))
    assert reqs[0].n_tokens >= res.prompt_tokens + len(res.tokens) - 1
    pred = predict_disk_reads(reqs, model_shape(mf), n_host, n_slots, policy=policy,
                              n_ubatch=512)
    expected = pred.reads + pred.initial_reads
    assert measured > 0 and abs(measured - expected) <= 0.15 * expected, (measured, pred)

