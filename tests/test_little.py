"""MoBiLE's little pass in the patch: a one-token ubatch routed to its top m experts computes the
model with m experts per token, equal to stock llama.cpp loaded with that expert count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from forecache.generate import SamplingParams, generate, last_logits
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.placement.options import CacheConfig
from tests.conftest import assert_same_tokens

if TYPE_CHECKING:
    from conftest import StockReference

PROMPTS = [[7], [301]]  # one token: every ubatch is a one-token ubatch, little when asked
N_GEN = 12


def _run(model: Path, cfg: CacheConfig, little: int) -> tuple[list, dict]:
    out = []
    with Llama.open(model, cache=cfg, n_ctx=128, n_threads=2) as llm:
        cache = llm.expert_cache
        assert cache is not None
        cache.set_little(little)
        for prompt in PROMPTS:
            res = generate(llm, prompt, N_GEN, SamplingParams(greedy=True), ignore_eos=True)
            out.append((res.tokens, last_logits(llm)))
        stats = cache.stats()
    return out, stats


@pytest.mark.parametrize(("preset", "policy", "little"), [
    ("tiny", "promoe", 1), ("tiny", "promoe", 2), ("tiny", "lru", 1), ("tiny", "lru", 2),
    # the chosen weights renormalized (a division), softmaxed after the choice (gpt-oss), or
    # chosen within groups (deepseek2): the little pass renormalizes over the experts it keeps
    ("tiny-qwen3moe", "promoe", 2), ("tiny-mixtral", "promoe", 1),
    ("tiny-olmoe", "promoe", 2), ("tiny-granitemoe", "promoe", 2),
    ("tiny-deepseek2", "promoe", 2), ("tiny-gpt-oss", "promoe", 2),
    ("tiny-lfm2moe", "promoe", 2)])
def test_little_pass_is_the_model_with_fewer_experts(tiny_model: Callable[..., Path],
                                                     stock: StockReference, preset: str,
                                                     policy: str, little: int) -> None:
    model = tiny_model("q8_0", preset)
    mf = read_model_file(model)
    assert little < mf.n_expert_used
    key = f"{mf.arch}.expert_used_count"
    fewer = stock.run(model, PROMPTS, N_GEN, n_ctx=128, n_threads=2,
                      kv_overrides={key: little})
    full = stock.run(model, PROMPTS, N_GEN, n_ctx=128, n_threads=2)
    cfg = CacheConfig(policy, cache_fraction=0.5, predictor="history")
    # the model with fewer experts is another model: the comparison below means something
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(fewer, full, strict=True))
    got, stats = _run(model, cfg, little)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, fewer, strict=True):
        if stock.backend != "cpu":  # the GPU check: equal up to rounding
            assert_same_tokens(tokens, ref_tokens, ref_logits, f"little {little}")
            continue
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits[-1])
    # the policy saw only each token's top m experts
    n_moe = len(mf.moe_layers())
    assert 0 < stats["hits"] + stats["misses"] <= len(PROMPTS) * (N_GEN + 1) * little * n_moe


def test_little_off_is_exact(tiny_model: Callable[[str], Path], stock: StockReference) -> None:
    """After a little pass, m = 0 gives the exact model again."""
    model = tiny_model("q8_0")
    full = stock.run(model, PROMPTS, N_GEN, n_ctx=128, n_threads=2)
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
    with Llama.open(model, cache=cfg, n_ctx=128, n_threads=2) as llm:
        cache = llm.expert_cache
        assert cache is not None
        cache.set_little(1)
        generate(llm, PROMPTS[0], 4, SamplingParams(greedy=True), ignore_eos=True)
        cache.set_little(0)
        for prompt, (ref_tokens, ref_logits) in zip(PROMPTS, full, strict=True):
            res = generate(llm, prompt, N_GEN, SamplingParams(greedy=True), ignore_eos=True)
            if stock.backend != "cpu":
                assert_same_tokens(res.tokens, ref_tokens, ref_logits, "little off")
                continue
            assert res.tokens == ref_tokens
            assert np.array_equal(last_logits(llm), ref_logits[-1])


NUMPY_TOKENS = [7, 301, 1000, 55, 1500, 90]
# numpy's float64 forward pass and llama.cpp's f16 kernels differ by about 0.2% of the logits'
# spread; dropping one expert of one layer moves them by far more
NUMPY_TOL = 0.01


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / ref.std())


def test_numpy_reference_is_the_stock_model(tiny_model: Callable[[str], Path],
                                            stock: StockReference) -> None:
    """The numpy forward pass the little pass is checked against computes what stock llama.cpp
    does, with all k experts and with m."""
    from tests.numpy_qwen2moe import Qwen2MoeNumpy

    model = tiny_model("f16")
    ref = Qwen2MoeNumpy(model)
    prompts = [[t] for t in NUMPY_TOKENS[:3]]
    full = stock.run(model, prompts, 1, n_ctx=128, n_threads=2)
    two = stock.run(model, prompts, 1, n_ctx=128, n_threads=2,
                    kv_overrides={"qwen2moe.expert_used_count": 2})
    for [tok], (_, a), (_, b) in zip(prompts, full, two, strict=True):
        assert _rel_err(a[0], ref.logits(tok)) < NUMPY_TOL
        kept2 = ref.logits(tok, lambda _il, top, _p: list(top[:2]))
        assert _rel_err(b[0], kept2) < NUMPY_TOL
        assert _rel_err(kept2, ref.logits(tok)) > 10 * NUMPY_TOL


@pytest.mark.parametrize("resident", [False, True], ids=["top-m", "resident"])
def test_little_pass_is_its_function_of_the_router(tiny_model: Callable[[str], Path],
                                                   resident: bool) -> None:
    """A little pass's logits equal numpy's forward pass from the GGUF over the experts it should
    keep: the top m, or (cache-conditional) the top-1 and those of the top m copied to their
    slots when the token routed, weighted by their router probabilities."""
    from forecache.native.cache_api import SLOT_READY
    from tests.numpy_qwen2moe import Qwen2MoeNumpy

    model = tiny_model("f16")
    ref = Qwen2MoeNumpy(model)
    m = ref.k if resident else 2
    dropped = kept_resident = 0  # the cases that make the resident check mean something
    cfg = CacheConfig("lru", cache_fraction=0.5)
    with Llama.open(model, cache=cfg, n_ctx=128, n_threads=2) as llm:
        cache = llm.expert_cache
        assert cache is not None
        for tok in NUMPY_TOKENS:
            # fills the slots with this run's experts: some of the token's top-k, not all
            generate(llm, [tok + 1], 3, SamplingParams(greedy=True), ignore_eos=True)
            cache.wait_idle()
            ready = []
            for il in range(ref.n_layer):
                experts, states = cache.layer_state(il)
                ready.append({int(e) for e, s in zip(experts, states, strict=True)
                              if e >= 0 and s == SLOT_READY})

            def keep(il: int, top: np.ndarray, _p: np.ndarray,
                     ready: list[set[int]] = ready) -> list[int]:
                nonlocal dropped, kept_resident
                if not resident:
                    return list(top[:m])
                kept = [int(top[0])] + [int(e) for e in top[1:m] if int(e) in ready[il]]
                dropped += m - len(kept)
                kept_resident += len(kept) - 1
                return kept

            before = dropped
            llm.reset()
            cache.set_little(m, resident)
            try:
                llm.eval([tok])
            finally:
                cache.set_little(0)
            want = ref.logits(tok, keep)
            got = last_logits(llm)
            assert _rel_err(got, want) < NUMPY_TOL, tok
            if not resident or dropped > before:  # the little pass is not the exact model
                assert _rel_err(got, ref.logits(tok)) > 10 * NUMPY_TOL, tok
    if resident:
        assert dropped > 0 and kept_resident > 0, (dropped, kept_resident)


def _mobile(model: Path, prompts: list[list[int]], gamma: float, little: int) -> tuple[list, dict]:
    out = []
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history", little_k=little,
                      gamma=gamma)
    with Llama.open(model, cache=cfg, n_ctx=128, n_threads=2) as llm:
        for prompt in prompts:
            res = generate(llm, prompt, N_GEN, SamplingParams(greedy=True), ignore_eos=True)
            out.append((res.tokens, last_logits(llm)))
        stats = llm.expert_stats()
    return out, stats


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3moe", "tiny-gpt-oss"])
def test_mobile_decoding_falls_back_to_the_full_model(tiny_model: Callable[..., Path],
                                                      stock: StockReference, preset: str) -> None:
    """gamma 1: the full model recomputes every token, its KV entries replacing the little
    pass's, so the run is the exact model's; gamma 0: never, so it is the model with m experts
    (renormalized ones in qwen3moe, softmaxed after the choice in gpt-oss, whose sliding-window
    cache has its last entries replaced too)."""
    model = tiny_model("q8_0", preset)
    key = f"{read_model_file(model).arch}.expert_used_count"
    prompts = [[7, 99, 23, 5], [301]]
    full = stock.run(model, prompts, N_GEN, n_ctx=128, n_threads=2)
    got, stats = _mobile(model, prompts, 1.0, 2)
    assert stats["mode"] == "mobile" and stats["little_k"] == 2
    assert stats["big_passes"] == stats["little_passes"] > 0
    assert stats["little_prefetches"] > 0  # the big passes prefetched the little passes' choice
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, full, strict=True):
        if stock.backend != "cpu":
            assert_same_tokens(tokens, ref_tokens, ref_logits, "gamma 1")
            continue
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits[-1])
    fewer = stock.run(model, PROMPTS, N_GEN, n_ctx=128, n_threads=2, kv_overrides={key: 2})
    got, stats = _mobile(model, PROMPTS, 0.0, 2)
    assert stats["big_passes"] == 0 and stats["little_passes"] > 0
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, fewer, strict=True):
        if stock.backend != "cpu":
            assert_same_tokens(tokens, ref_tokens, ref_logits, "gamma 0")
            continue
        assert tokens == ref_tokens
        assert np.array_equal(logits, ref_logits[-1])


def test_mobile_needs_the_cache(tiny_model: Callable[[str], Path]) -> None:
    from tests.cli_helpers import run_cli, run_cli_json

    model = str(tiny_model("q8_0"))
    res = run_cli("generate", "-m", model, "-p", "Hello", "-n", "4", "--mode", "mobile")
    assert res.returncode != 0 and "--policy promoe" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = run_cli("generate", "-m", model, "-p", "Hello", "-n", "4", "--policy", "promoe",
                  "--cache-fraction", "0.5", "--mode", "mobile", "--little-k", "4")
    assert res.returncode != 0 and "--little-k 4" in res.stderr, res.stderr
    out = run_cli_json("generate", "-m", model, "-p", "Hello", "-n", "4", "--policy", "promoe",
                       "--cache-fraction", "0.5", "--mode", "mobile", "--gamma", "0")
    assert out["stats"]["mode"] == "mobile" and out["stats"]["little_passes"] > 0
    assert out["stats"]["little_k"] == 2 and not out["stats"]["little_resident"]
    # cache-conditional: every resident expert of the top-k (the whole of it) by default
    out = run_cli_json("generate", "-m", model, "-p", "Hello", "-n", "4", "--policy", "promoe",
                       "--cache-fraction", "0.5", "--mode", "mobile", "--gamma", "0",
                       "--little-resident")
    assert out["stats"]["little_k"] == 4 and out["stats"]["little_resident"]
    assert out["stats"]["little_passes"] > 0
    exact = run_cli_json("generate", "-m", model, "-p", "Hello", "-n", "4", "--policy",
                         "promoe", "--cache-fraction", "0.5")
    assert exact["stats"]["mode"] == "exact"
    # the drop-in keywords
    llm = Llama(model, policy="promoe", cache_fraction=0.5, mode="mobile", gamma=0.0,
                n_ctx=128, verbose=False)
    try:
        generate(llm, [7], 3, SamplingParams(greedy=True), ignore_eos=True)
        stats = llm.expert_stats()
        assert stats["mode"] == "mobile" and stats["little_passes"] > 0
        from forecache.chat import mobile_summary

        assert "mobile (lossy)" in mobile_summary(stats)
    finally:
        llm.close()
