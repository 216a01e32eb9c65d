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

A task besides: line completion on the same held-out code (``--lines N``, default 120; 0 skips
it). N lines of at least 24 characters, evenly spaced, are cut at the first space past their
middle; the model gets the 40 lines before and the line's first part, and completes it greedily
up to the end of the line (at most 32 tokens). Scored as CodeXGLUE scores line completion: exact
match with the true rest of the line, and edit similarity (difflib's ratio, 0-100; the change
against the exact model's is paired, with a 95% interval); also the share of completions equal to
the exact model's. Generated tokens, unlike the positions above, keep their little passes' KV
entries when the pass is sure, so errors can compound.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from forecache.generate import last_logits
from forecache.llama import Llama
from forecache.models.default import REFERENCE_MODEL
from forecache.placement.options import CacheConfig

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


CONTEXT_LINES = 40
MAX_COMPLETION = 32


def _line_tasks(text: str, n: int) -> list[tuple[str, str]]:
    """(prompt, the line's true rest) for ``n`` evenly spaced lines of the text."""
    lines = text.split("\n")
    cand = [i for i, line in enumerate(lines)
            if i >= CONTEXT_LINES // 2 and len(line.strip()) >= 24]
    tasks = []
    for i in cand[::max(len(cand) // max(n, 1), 1)][:n]:
        line = lines[i]
        cut = line.find(" ", len(line) - len(line.lstrip()) + len(line.strip()) // 2)
        cut = cut if cut > 0 else len(line) // 2
        context = "\n".join(lines[max(i - CONTEXT_LINES, 0):i])
        tasks.append((context + "\n" + line[:cut], line[cut:]))
    return tasks


def _complete(cfg: CacheConfig, tasks: list[tuple[str, str]], threads: int) -> dict:
    """Greedy completion of each task's line; the completions, their exact-match rate, and
    the run's time per generated token and mobile counters."""
    done, n_gen, t_gen = [], 0, 0.0
    with Llama.open(MODEL, cache=cfg, n_ctx=2048, n_threads=threads) as llm:
        llm.reset_stats()
        for prompt, _ in tasks:
            llm.reset()
            llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=False))
            out: list[int] = []
            t0 = time.perf_counter()
            while len(out) < MAX_COMPLETION:
                tok = int(np.argmax(last_logits(llm)))
                if llm.is_eog(tok):
                    break
                out.append(tok)
                if b"\n" in llm.detokenize(out):
                    break
                llm.eval([tok])
            t_gen += time.perf_counter() - t0
            n_gen += len(out)
            done.append(llm.detokenize(out).decode("utf-8", "replace").split("\n")[0])
        stats = llm.expert_stats()
    pairs = list(zip(done, (rest for _, rest in tasks), strict=True))
    exact = float(np.mean([c == rest for c, rest in pairs]))
    sim = np.array([100 * difflib.SequenceMatcher(None, c, rest).ratio() for c, rest in pairs])
    return {"completions": done, "exact_match": exact, "edit_sim": sim,
            "s_per_token": t_gen / max(n_gen, 1),
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


def _settings(args: argparse.Namespace) -> Iterator[tuple[str, float, CacheConfig]]:
    """(little-k, gamma, CacheConfig) of each mobile run the arguments ask for."""
    for m in args.little_k.split(","):
        resident = m == "resident"
        for gamma in (float(x) for x in args.gammas.split(",")):
            yield m, gamma, CacheConfig("promoe", cache_fraction=args.cache_fraction,
                                        predictor="history",
                                        little_k=-1 if resident else int(m), gamma=gamma,
                                        little_resident=resident)


def _lines_table(args: argparse.Namespace, base: CacheConfig) -> list[dict]:
    """The line-completion task, exact and at each setting: printed, and its rows."""
    tasks = _line_tasks(VALID.read_text(), args.lines)
    exact = _complete(base, tasks, args.threads)
    n = len(tasks)
    print(f"\nline completion: {n} lines; exact model: exact match {exact['exact_match']:.3f}, "
          f"edit similarity {exact['edit_sim'].mean():.1f}, "
          f"{exact['s_per_token'] * 1e3:.2f} ms a generated token\n")
    print("| little-k | gamma | full model recomputes | exact match | edit similarity | "
          "change (95%) | same completion as exact (95%) | ms a token | over exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for m, gamma, cfg in _settings(args):
        r = _complete(cfg, tasks, args.threads)
        same = float(np.mean([a == b for a, b in zip(r["completions"],
                                                      exact["completions"], strict=True)]))
        em = r["exact_match"]
        d = r["edit_sim"] - exact["edit_sim"]
        d_half = 1.96 * d.std(ddof=1) / math.sqrt(n) if n > 1 else 0.0
        s_half = 1.96 * math.sqrt(same * (1 - same) / n)
        share = r["big_passes"] / max(r["little_passes"], 1)
        rows.append({"little_k": m, "gamma": gamma, "fallback": share, "exact_match": em,
                     "edit_sim": float(r["edit_sim"].mean()),
                     "edit_sim_change": float(d.mean()), "edit_sim_change_ci": d_half,
                     "same": same, "same_ci": s_half,
                     "s_per_token": r["s_per_token"]})
        print(f"| {m} | {gamma:.1f} | {share:.3f} | {em:.3f} | {r['edit_sim'].mean():.1f} | "
              f"{d.mean():+.2f} +- {d_half:.2f} | {same:.3f} +- {s_half:.3f} | "
              f"{r['s_per_token'] * 1e3:.2f} | "
              f"{exact['s_per_token'] / r['s_per_token']:.2f}x |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--gammas", default="0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--little-k", default="1,2,resident",
                    help="little-pass sizes: numbers, or 'resident' (top-1 + experts in slots)")
    ap.add_argument("--cache-fraction", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lines", type=int, default=120,
                    help="line-completion tasks (0: none)")
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
    for m, gamma, cfg in _settings(args):
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
    lines = _lines_table(args, base) if args.lines else []
    if args.json:
        args.json.write_text(json.dumps({"model": MODEL.name, "positions": n,
                                         "cache_fraction": args.cache_fraction,
                                         "exact": {"perplexity": ppl,
                                                   "s_per_token": exact["s_per_token"]},
                                         "runs": rows, "line_completion": lines}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        _plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
