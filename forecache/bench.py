"""Policy benchmark: every policy on the same prompts in one process, with ratios to baselines."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from forecache.cache.setup import CacheConfig
from forecache.engine import CALIBRATION_TEXT, Engine, SamplingParams

BASELINES = ("offload", "ncmoe", "lru")


@dataclass
class PolicyResult:
    """Means over the prompts of one policy's runs."""

    policy: str
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    hit_rate: float
    h2d_gb: float
    stall_share: float
    cache_slots: int
    host_layers: int
    ratios: dict[str, dict[str, float]]


def bench_prompts(engine: Engine, n_prompts: int, prompt_len: int,
                  seed: int = 0) -> list[list[int]]:
    """``n_prompts`` prompts of exactly ``prompt_len`` tokens: seeded shuffles of English words."""
    words = CALIBRATION_TEXT.split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n_prompts):
        ids: list[int] = []
        while len(ids) < prompt_len:
            rng.shuffle(words)
            ids += engine.tokenize(" ".join(words))
        prompts.append(ids[:prompt_len])
    return prompts


def run_policy(model: Path, cfg: CacheConfig | None, prompts: list[list[int]], n_gen: int, *,
               n_ctx: int, n_threads: int | None) -> dict:
    """Load the model under ``cfg``, warm up, then generate ``n_gen`` tokens for every prompt."""
    with Engine(model, n_ctx=n_ctx, n_threads=n_threads, cache=cfg) as eng:
        eng.generate(prompts[0][:8], 2, SamplingParams(greedy=True), ignore_eos=True)
        if eng.expert_cache is not None:
            eng.expert_cache.reset_stats()
        runs = []
        t0 = time.perf_counter()
        for p in prompts:
            runs.append(eng.generate(p, n_gen, SamplingParams(greedy=True), ignore_eos=True))
        wall = time.perf_counter() - t0
        stats = eng.cache_stats()
    n = len(runs)
    routed = stats["hits"] + stats["misses"]
    tpot = sum(r.tpot_s for r in runs) / n
    return {
        "ttft_s": sum(r.ttft_s for r in runs) / n,
        "tpot_s": tpot,
        "tokens_per_s": 1.0 / tpot if tpot > 0 else 0.0,
        "hit_rate": stats["hits"] / routed if routed else 0.0,
        "h2d_gb": stats["h2d_bytes"] / 1e9,
        "stall_share": stats["stall_s"] / wall if wall > 0 else 0.0,
        "cache_slots": stats["cache_slots"],
        "host_layers": stats["host_layers"],
        "tokens": [r.tokens for r in runs],
    }


def run_bench(model: Path, policies: list[str], *, gpu_budget: int | None,
              cache_fraction: float | None, prompt_len: int, n_gen: int, n_prompts: int = 3,
              n_ctx: int | None = None, n_threads: int | None = None,
              progress: Callable[[str], None] = lambda s: None) -> dict:
    """Every policy on the same prompts; returns results, ratios and whether tokens agreed."""
    n_ctx = n_ctx or max(512, prompt_len + n_gen + 16)
    with Engine(model, n_ctx=n_ctx) as eng:
        prompts = bench_prompts(eng, n_prompts, prompt_len)
    raw: dict[str, dict] = {}
    for pol in policies:
        if pol == "ncmoe" and gpu_budget is None:
            progress("ncmoe skipped: it needs --gpu-budget")
            continue
        progress(f"running {pol} ...")
        sized = pol != "offload"
        cfg = CacheConfig(policy=pol, gpu_budget=gpu_budget,
                          cache_fraction=cache_fraction if sized and gpu_budget is None else None)
        raw[pol] = run_policy(model, cfg, prompts, n_gen, n_ctx=n_ctx, n_threads=n_threads)
    results = []
    for pol, r in raw.items():
        ratios = {}
        for base in BASELINES:
            if base in raw and base != pol:
                b = raw[base]
                ratios[base] = {
                    "ttft_speedup": b["ttft_s"] / r["ttft_s"] if r["ttft_s"] > 0 else 0.0,
                    "decode_speedup": b["tpot_s"] / r["tpot_s"] if r["tpot_s"] > 0 else 0.0,
                }
        fields = {k: v for k, v in r.items() if k != "tokens"}
        results.append(PolicyResult(policy=pol, ratios=ratios, **fields))
    first = next(iter(raw.values()))["tokens"] if raw else []
    return {
        "model": str(model), "prompt_len": prompt_len, "gen": n_gen, "n_prompts": n_prompts,
        "gpu_budget": gpu_budget, "cache_fraction": cache_fraction,
        "same_tokens": all(r["tokens"] == first for r in raw.values()),
        "results": [asdict(r) for r in results],
    }


def format_table(report: dict) -> str:
    """The benchmark as a fixed-width text table."""
    head = (f"{'policy':<8} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>8} {'hit %':>6} "
            f"{'H2D GB':>8} {'stall %':>8} {'vs offload':>18} {'vs ncmoe':>18} {'vs lru':>18}")
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        def ratio(base: str, r: dict = r) -> str:
            x = r["ratios"].get(base)
            return f"{x['ttft_speedup']:.2f}x/{x['decode_speedup']:.2f}x" if x else "-"
        lines.append(f"{r['policy']:<8} {r['ttft_s'] * 1e3:>9.1f} {r['tpot_s'] * 1e3:>9.2f} "
                     f"{r['tokens_per_s']:>8.1f} {r['hit_rate'] * 100:>6.1f} {r['h2d_gb']:>8.3f} "
                     f"{r['stall_share'] * 100:>8.1f} {ratio('offload'):>18} {ratio('ncmoe'):>18} "
                     f"{ratio('lru'):>18}")
    lines.append("ratios: prefill (TTFT) speedup / decode (TPOT) speedup; same greedy tokens: "
                 f"{'yes' if report['same_tokens'] else 'NO'}")
    return "\n".join(lines)
