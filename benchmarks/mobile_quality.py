"""MoBiLE decoding on the trained reference model: quality and speed by gamma and little-k.

    python benchmarks/mobile_quality.py [--tokens 1024] [--gammas 0.5,0.6,0.7,0.8,0.9]
        [--little-k 1,2,resident] [--cache-fraction 0.5] [--threads 2] [--json OUT] [--plot OUT.png]

The reference model's held-out text (``forecache-ref-valid.txt``, never trained on) is fed one token
at a time, as decoding feeds generated tokens, under the exact model and under ``--mode mobile``
at each gamma and little-pass size ("resident": the cache-conditional pass, the top expert and
those already in device slots; promoe at ``--cache-fraction``). At every position the
next-token distribution the run ends with (the little pass's, or the full model's after a
fallback) scores the true next token: perplexity, the mean change in its log-likelihood against
the exact run (paired, with a 95% interval), and agreement of the top token with the exact run's
(95% interval). Also the share of tokens the full model recomputed and the time per token on this
machine (both modes evaluate the same tokens one at a time, taking turns in that order).
``--plot`` draws quality against the share of tokens recomputed (needs matplotlib:
``pip install 'forecache[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from forecache.cache.setup import CacheConfig
from forecache.default_model import REFERENCE_MODEL
from forecache.generate import last_logits
from forecache.llama import Llama

MODEL = REFERENCE_MODEL
VALID = REFERENCE_MODEL.with_name("forecache-ref-valid.txt")


def _run(cfg: CacheConfig, tokens: list[int], threads: int) -> dict:
    """Feed ``tokens`` one at a time; per position the log-probability of the next token and
    the top token; the run's time per token and mobile counters."""
    logp, top = [], []
    with Llama.open(MODEL, cache=cfg, n_ctx=len(tokens) + 8, n_threads=threads) as llm:
        llm.reset_stats()
        t0 = time.perf_counter()
        for i in range(len(tokens) - 1):
            llm.eval([tokens[i]])
            z = last_logits(llm).astype(np.float64)
            lse = np.logaddexp.reduce(z)
            logp.append(z[tokens[i + 1]] - lse)
            top.append(int(np.argmax(z)))
        dt = (time.perf_counter() - t0) / (len(tokens) - 1)
        stats = llm.expert_stats()
    return {"logp": np.array(logp), "top": np.array(top), "s_per_token": dt,
            "little_passes": stats.get("little_passes", 0),
            "big_passes": stats.get("big_passes", 0)}


def _plot(rows: list[dict], path: Path) -> None:
    """Top-token agreement and log-likelihood change against the share recomputed, a line per
    little-pass size, each point labelled with its gamma."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'forecache[plot]'") from e
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m in dict.fromkeys(r["little_k"] for r in rows):
        rs = [r for r in rows if r["little_k"] == m]
        x = [r["fallback"] for r in rs]
        axes[0].errorbar(x, [r["agree"] for r in rs], yerr=[r["agree_ci"] for r in rs],
                         marker="o", capsize=3, label=f"little-k {m}")
        axes[1].errorbar(x, [r["dlogp"] for r in rs], yerr=[r["dlogp_ci"] for r in rs],
                         marker="o", capsize=3, label=f"little-k {m}")
        for r in rs:
            axes[0].annotate(f"{r['gamma']:.1f}", (r["fallback"], r["agree"]), fontsize=7,
                             textcoords="offset points", xytext=(3, 3))
    axes[0].set(xlabel="share of tokens the full model recomputes",
                ylabel="top token agrees with exact (95% CI)")
    axes[1].axhline(0.0, color="grey", lw=0.8)
    axes[1].set(xlabel="share of tokens the full model recomputes",
                ylabel="log-likelihood change, nats/token (95% CI)")
    for ax in axes:
        ax.legend()
    fig.suptitle("MoBiLE on the reference model's held-out text (labels: gamma)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--gammas", default="0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--little-k", default="1,2,resident",
                    help="little-pass sizes: numbers, or 'resident' (top-1 + experts in slots)")
    ap.add_argument("--cache-fraction", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    with Llama.open(MODEL, cache=None, n_ctx=64) as llm:
        tokens = llm.tokenize(VALID.read_bytes(), add_bos=True, special=False)[:args.tokens]
    base = CacheConfig("promoe", cache_fraction=args.cache_fraction, predictor="history")
    exact = _run(base, tokens, args.threads)
    n = len(exact["logp"])
    print(f"reference model ({MODEL.name}), {n} held-out positions, promoe at cache fraction "
          f"{args.cache_fraction}, {platform.machine()} with {os.cpu_count()} CPUs, "
          f"{args.threads} threads\n")
    ppl = math.exp(-exact["logp"].mean())
    print(f"exact: perplexity {ppl:.3f}, {exact['s_per_token'] * 1e3:.2f} ms a token\n")
    print("| little-k | gamma | full model recomputes | perplexity | log-likelihood change "
          "(95%) | top token agrees (95%) | ms a token | over exact |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for m in args.little_k.split(","):
        resident = m == "resident"
        for gamma in (float(x) for x in args.gammas.split(",")):
            cfg = CacheConfig("promoe", cache_fraction=args.cache_fraction,
                              predictor="history", little_k=-1 if resident else int(m),
                              gamma=gamma, little_resident=resident)
            r = _run(cfg, tokens, args.threads)
            d = r["logp"] - exact["logp"]
            half = 1.96 * d.std(ddof=1) / math.sqrt(n)
            agree = float((r["top"] == exact["top"]).mean())
            a_half = 1.96 * math.sqrt(agree * (1 - agree) / n)
            share = r["big_passes"] / max(r["little_passes"], 1)
            row = {"little_k": m, "gamma": gamma, "fallback": share,
                   "perplexity": math.exp(-r["logp"].mean()), "dlogp": float(d.mean()),
                   "dlogp_ci": half, "agree": agree, "agree_ci": a_half,
                   "s_per_token": r["s_per_token"]}
            rows.append(row)
            print(f"| {m} | {gamma:.1f} | {share:.3f} | {row['perplexity']:.3f} | "
                  f"{d.mean():+.4f} +- {half:.4f} | {agree:.3f} +- {a_half:.3f} | "
                  f"{r['s_per_token'] * 1e3:.2f} | "
                  f"{exact['s_per_token'] / r['s_per_token']:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": MODEL.name, "positions": n,
                                         "cache_fraction": args.cache_fraction,
                                         "exact": {"perplexity": ppl,
                                                   "s_per_token": exact["s_per_token"]},
                                         "runs": rows}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        _plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
