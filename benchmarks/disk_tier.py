"""The disk tier measured on this machine: a model whose experts mostly stay in the GGUF file,
decoded with a real model's routing replayed, against the same run with every expert in memory.

Makes (once, in the cache directory) a random-weight GGUF of the traced model's shape, replays
the shared Qwen1.5-MoE decode trace's routing in every expert matmul (random weights route a few
experts and flatter any cache), and runs each policy with host budgets that hold a share of the
experts; the rest are read from the file with direct I/O as copies and host compute need them.
Prints a table (tokens/s, experts and bytes read a token, the time waited for reads, host-tier
hit rate) and writes --json. The tokens are meaningless under a replayed routing (lossless is
tests/test_disk_tier.py's job).

    .venv/bin/python benchmarks/disk_tier.py --json disk_tier.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from forecache.cache.budget import format_size, slots_for_fraction
from forecache.cache.disk import host_weight_bytes
from forecache.cache.policies import hit_rate
from forecache.generate import SamplingParams, generate
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.paths import cache_dir
from forecache.placement.options import CacheConfig

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "qwen15_moe_a27b_nf4gemm_decode_4x512.npz"
PRESET = "qwen1.5-moe-a2.7b"


def model_path(preset: str, qtype: str) -> Path:
    """The benchmark's model, made on first use."""
    out = cache_dir() / "bench-models" / f"{preset}-{qtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"making {out} (once)...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "forecache", "make-model", "--preset", preset,
                        "--type", qtype, str(out)], check=True)
    return out


def host_budget_for(model: Path, share: float, slot_fraction: float) -> int:
    """A CPU build's host budget that keeps ``share`` of the experts in host slots beside the
    non-expert weights and the (host-memory) device slots."""
    mf = read_model_file(model)
    per = max(mf.layer_expert_bytes())
    slots = sum(slots_for_fraction(mf, slot_fraction))
    return host_weight_bytes(mf, on_gpu=False) + slots * per + int(mf.total_expert_bytes() * share)


def run(model: Path, cfg: CacheConfig, prompt: list[int], n_gen: int, threads: int | None,
        trace: Path) -> dict:
    """Prefill ``prompt`` (after a warm-up prompt), then decode ``n_gen`` tokens greedily, with
    ``trace``'s routing replayed: the prompt's time and the decode's time and counters alone."""
    with Llama.open(model, cache=cfg, n_ctx=512, n_threads=threads, use_mmap=False,
                    routing_trace=trace) as llm:
        greedy = SamplingParams(greedy=True)
        generate(llm, prompt[::-1], 2, greedy, ignore_eos=True)  # warm-up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        ttft = time.perf_counter() - t0
        llm.expert_cache.reset_stats()
        t0 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([llm.sample(temp=0.0)])
        tpot = (time.perf_counter() - t0) / n_gen
        stats = llm.expert_stats()
        if llm.replay is not None:
            llm.replay.check()
    return {"ttft_s": ttft, "tpot_s": tpot, "stats": stats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=PRESET)
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--policies", default="lru,promoe")
    ap.add_argument("--shares", default="0.25,0.5",
                    help="shares of the experts the host slots hold")
    ap.add_argument("--slot-fraction", type=float, default=0.125,
                    help="device slots a layer, as a share of its experts")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    model = model_path(a.preset, a.type)
    mf = read_model_file(model)
    prompt = [(7 * i + 11) % 1000 + 10 for i in range(a.prompt_len)]
    rows = []
    for policy in a.policies.split(","):
        for share in [None] + [float(x) for x in a.shares.split(",")]:
            budget = None if share is None else host_budget_for(model, share, a.slot_fraction)
            cfg = CacheConfig(policy, cache_fraction=a.slot_fraction, host_budget=budget)
            t0 = time.perf_counter()
            r = run(model, cfg, prompt, a.gen, a.threads, a.trace)
            s = r["stats"]
            n = a.gen
            row = {"policy": policy, "host_share": share,
                   "host_budget": budget, "tokens_per_s": 1.0 / r["tpot_s"],
                   "tpot_ms": r["tpot_s"] * 1e3, "ttft_ms": r["ttft_s"] * 1e3,
                   "hit_rate": hit_rate(s["hits"], s["misses"]) or 0.0,
                   "wall_s": time.perf_counter() - t0}
            if "disk_reads" in s:
                row.update(reads_per_token=s["disk_reads"] / n,
                           mb_per_token=s["disk_bytes"] / n / 1e6,
                           direct_share=s["disk_direct_bytes"] / max(s["disk_bytes"], 1),
                           wait_ms_per_token=s["disk_wait_s"] * 1e3 / n,
                           host_hit_rate=s["host_hit_rate"])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)

    print(f"\n{model.name}: {mf.n_layer} layers, {mf.n_expert} experts top-{mf.n_expert_used}, "
          f"{format_size(mf.total_expert_bytes())} of experts; routing {a.trace.name}; "
          f"{platform.processor() or platform.machine()}, CPU build")
    print("| policy | experts in host slots | tokens/s | vs in memory | experts read a token | "
          "MB read a token | read waits ms a token | host-tier hit % | direct I/O |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {r["policy"]: r["tokens_per_s"] for r in rows if r["host_share"] is None}
    for r in rows:
        share = "all (no disk tier)" if r["host_share"] is None else f"{r['host_share']:.0%}"
        rel = r["tokens_per_s"] / base[r["policy"]] if base.get(r["policy"]) else 0.0
        disk = ("-", "-", "-", "-", "-") if "reads_per_token" not in r else (
            f"{r['reads_per_token']:.1f}", f"{r['mb_per_token']:.1f}",
            f"{r['wait_ms_per_token']:.1f}", f"{(r['host_hit_rate'] or 0) * 100:.0f}",
            f"{r['direct_share']:.0%}")
        print(f"| {r['policy']} | {share} | {r['tokens_per_s']:.1f} | {rel:.2f}x | "
              + " | ".join(disk) + " |")
    if a.json:
        a.json.write_text(json.dumps({"model": str(model), "trace": str(a.trace),
                                      "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
