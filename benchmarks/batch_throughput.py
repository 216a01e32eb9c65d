"""Batch-job throughput against the number of sequences decoded together (forecache batch).

    python benchmarks/batch_throughput.py [-m MODEL] [--requests 32] [--max-tokens 64] \
        [--parallel 1,2,4,8] [--policy P --cache-fraction F] [--json OUT.json]

Runs the same greedy requests (the builtin prompts) at each --parallel in one process and prints
generated tokens/s and the speedup over --parallel 1; --json also writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from forecache.batch import decode_many
from forecache.generate import SamplingParams
from forecache.jobs.requests import Request
from forecache.llama import Llama
from forecache.models.default import ensure_default_model
from forecache.placement.options import Options

PROMPTS = Path(__file__).resolve().parent.parent / "forecache" / "data" / "prompts" / \
    "default.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--parallel", default="1,2,4,8")
    ap.add_argument("--ctx-per-seq", type=int, default=1024)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--cache-fraction", type=float, default=None)
    ap.add_argument("--gpu-budget", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    a = ap.parse_args()

    model = a.model or ensure_default_model()
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    greedy = SamplingParams(greedy=True, temperature=0.0)
    reqs = [Request(id=str(i), line=i + 1, prompt=texts[i % len(texts)][:400],
                    max_tokens=a.max_tokens, sampling=greedy) for i in range(a.requests)]
    threads = a.threads or os.cpu_count() or 1
    rows = []
    for n in [int(x) for x in a.parallel.split(",")]:
        cfg = Options(policy=a.policy, gpu_budget=a.gpu_budget,
                      cache_fraction=a.cache_fraction).cache_config()
        llm = Llama(model, cache=cfg, n_seq_max=n, n_ctx=a.ctx_per_seq * n, n_threads=threads,
                    n_threads_batch=threads, verbose=False)
        done: list[dict] = []
        t0 = time.perf_counter()
        decode_many(llm, reqs, n, done.append)
        wall = time.perf_counter() - t0
        stats = llm.expert_stats()
        llm.close()
        tokens = sum(r.get("tokens", 0) for r in done)
        rows.append({"parallel": n, "requests": len(done), "tokens": tokens, "wall_s": wall,
                     "tokens_per_s": tokens / wall, "policy": stats["policy"],
                     "hit_rate": stats["hit_rate"]})
    base = rows[0]["tokens_per_s"]
    print(f"model {model.name}, {a.requests} requests x {a.max_tokens} tokens (greedy), "
          f"{threads} threads, {platform.processor() or platform.machine()}")
    print(f"{'parallel':>8} {'tokens':>7} {'wall s':>7} {'tokens/s':>9} {'speedup':>8} "
          f"{'policy':>8} {'hit':>5}")
    for r in rows:
        hit = f"{r['hit_rate'] * 100:.0f}%" if r["hit_rate"] is not None else "-"
        print(f"{r['parallel']:>8} {r['tokens']:>7} {r['wall_s']:>7.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / base:>7.2f}x "
              f"{r['policy']:>8} {hit:>5}")
    if a.json:
        a.json.write_text(json.dumps({"model": model.name, "threads": threads,
                                      "machine": platform.machine(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
