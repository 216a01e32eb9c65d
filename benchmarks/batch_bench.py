"""A batch job measured: stock llama.cpp's best plan against forecache's, on replayed routing.

    python benchmarks/batch_bench.py -m MODEL --routing-trace TRACE --gpu-budget 24GiB \
        [--requests 64] [--scale 0.25] [--threads N] [--json OUT.json] \
        [--plans auto | "seq=64,ubatch=512,kv=host,experts=ncmoe;seq=256,ubatch=1024,kv=host"]

Every plan decodes the same requests (lengths drawn from ShareGPT-like lognormals,
``sim.run.SHAREGPT``, times ``--scale``) as ``forecache batch`` does (``batch.decode_many``), each
request reading its own rows of the routing replayed (``trace.replay``), in one process:
whole-job generated tokens a second, and each plan's ratio over the best stock plan measured.
``--plans auto`` measures, for stock llama.cpp (``experts=ncmoe``), for forecache's cache and,
where prompt banks are placed (on a GPU), for forecache's cache in micro-batches, the
``--per-kind`` plans the batch roofline predicts fastest on this device's profile; each row sets the
roofline's prediction (HRM) beside the measured figure. A random-weight
model's tokens are meaningless under a replayed routing; both placements compute the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from forecache.batch import decode_many
from forecache.cache.budget import BudgetError, parse_size
from forecache.cache.cost import Profile
from forecache.generate import SamplingParams
from forecache.gguf.header import require_moe
from forecache.jobs.plan import job_workload, plan_cache
from forecache.jobs.requests import Request
from forecache.llama import Llama
from forecache.native.ggml_devices import cache_device
from forecache.placement.before import banks_asked
from forecache.placement.costs import default_machine
from forecache.placement.options import Options
from forecache.roofline.batch import MICRO_MAX, BatchPlan, batch_tokens, estimate, search
from forecache.roofline.shape import model_shape
from forecache.sim.run import SHAREGPT

# the words a prompt is made of: one token each in the made models' vocabulary
WORD = " the"


def requests(n: int, scale: float, seed: int) -> list[Request]:
    """``n`` greedy requests whose prompt and answer lengths follow ShareGPT's, times ``scale``."""
    prompts, answers = SHAREGPT.draw(n, np.random.default_rng(seed))
    greedy = SamplingParams(greedy=True, temperature=0.0)
    return [Request(id=f"r{i}", line=i + 1, prompt=WORD * max(1, int(p * scale)),
                    max_tokens=max(2, int(a * scale)), sampling=greedy)
            for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]


def prompt_tokens(req: Request) -> int:
    """The tokens of a prompt ``requests`` made (a word a token)."""
    return len(req.prompt or "") // len(WORD)


def predicted(model: Path, budget: int, reqs: list[Request], ctx_per_seq: int,
              plans: list[BatchPlan] | None, per_kind: int = 2) -> list[tuple[BatchPlan, float]]:
    """``plans`` with the roofline's tokens/s for each on this device's profile (prompt banks
    on a GPU, as the runtime places them); None: the ``per_kind`` plans it predicts fastest
    for stock llama.cpp and for forecache's cache."""
    mf = require_moe(model)
    work = job_workload([prompt_tokens(r) for r in reqs],
                        [r.max_tokens for r in reqs], ctx_per_seq)
    dev = cache_device()
    profile = Profile.load(default_machine(dev))
    shape, ne = model_shape(mf), mf.non_expert_bytes()
    # prompt banks by the runtime's own rule, for the cache plans run_plan opens
    bank = banks_asked(plan_cache(Options(gpu_budget=budget).cache_config(), BatchPlan(1, 1)),
                       dev.type)
    if plans is not None:
        out = []
        for plan in plans:
            e = estimate(shape, profile, budget, work, plan, non_expert_bytes=ne, bank=bank)
            out.append((plan, e.tokens_per_s if e is not None else 0.0))
        return out
    found: list[tuple[BatchPlan, float]] = []
    for kind in ("ncmoe", "cache"):
        got = search(shape, profile, budget, work, experts=(kind,), non_expert_bytes=ne,
                     bank=bank)
        found += [(e.plan, e.tokens_per_s) for e in got[:per_kind]]
    if bank:  # and forecache's fastest in micro-batches, which share the banks
        got = search(shape, profile, budget, work, non_expert_bytes=ne, bank=bank,
                     micros=range(2, MICRO_MAX + 1))
        found += [(e.plan, e.tokens_per_s) for e in got[:per_kind] if e.plan.micro > 1]
    return found


def run_plan(model: Path, trace: Path | None, budget: str, plan: BatchPlan,
             reqs: list[Request], ctx_per_seq: int, threads: int) -> dict:
    """One plan's whole job: generated tokens a second and the expert cache's figures."""
    cfg = plan_cache(Options(gpu_budget=budget).cache_config(), plan)
    n_seq = min(plan.n_seq, len(reqs))
    t0 = time.perf_counter()
    try:
        llm = Llama.open(model, cache=cfg, routing_trace=trace, n_ctx=ctx_per_seq,
                         n_seq_max=n_seq, n_threads=threads,
                         n_batch=batch_tokens(n_seq, plan.n_ubatch), n_ubatch=plan.n_ubatch,
                         offload_kqv=not plan.kv_host, micro=plan.micro)
    except BudgetError as e:  # (a micro plan's contexts may not fit beside the experts)
        return {"plan": plan.label(), "experts": plan.experts, "skipped": str(e)}
    load_s = time.perf_counter() - t0
    done: list[dict] = []
    cache = llm.expert_cache
    if plan.micro > 1 and (cache is None or cache.bank_tokens <= 0):
        llm.close()  # (every expert fits: no bank to share, nothing for micro-batches to do)
        return {"plan": plan.label(), "experts": plan.experts, "skipped": "no prompt banks"}
    try:
        t0 = time.perf_counter()
        decode_many(llm, reqs, n_seq, done.append, micro=plan.micro)
        wall = time.perf_counter() - t0
        stats = llm.expert_stats()
    finally:
        llm.close()
    tokens = sum(r.get("tokens", 0) for r in done)
    failed = [r for r in done if "error" in r]
    return {"plan": plan.label(), "experts": plan.experts, "policy": stats["policy"],
            "requests": len(done), "failed": len(failed), "tokens": tokens, "wall_s": wall,
            "load_s": load_s, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "hit_rate": stats.get("hit_rate"), "h2d_gb": stats.get("h2d_bytes", 0) / 1e9,
            "stall_s": stats.get("stall_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--routing-trace", type=Path, default=None,
                    help="replay this routing (a random-weight model's own routes a few experts)")
    ap.add_argument("--gpu-budget", default="24GiB")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--scale", type=float, default=0.25,
                    help="prompt and answer lengths times this (a shorter job)")
    ap.add_argument("--ctx-per-seq", type=int, default=None,
                    help="each sequence's context (default: the longest request's, rounded up)")
    ap.add_argument("--plans", default="auto",
                    help="auto, or plans separated by ';' "
                         "(seq=N,ubatch=U[,kv=host][,experts=ncmoe][,micro=M])")
    ap.add_argument("--micro", type=int, default=1,
                    help="also run each forecache plan with this many micro-batches a step "
                         "(2 to 4: the prompts in micro - 1 contexts of their own)")
    ap.add_argument("--per-kind", type=int, default=2,
                    help="with --plans auto: the plans measured for stock and for forecache each")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    a = ap.parse_args()

    reqs = requests(a.requests, a.scale, a.seed)
    longest = max(prompt_tokens(r) + r.max_tokens for r in reqs)
    ctx = a.ctx_per_seq or -(-(longest + 16) // 256) * 256
    budget = parse_size(a.gpu_budget)
    given = None if a.plans == "auto" else \
        [BatchPlan.parse(p) for p in a.plans.split(";") if p.strip()]
    plans = predicted(a.model, budget, reqs, ctx, given, a.per_kind)
    if a.micro > 1:  # each forecache plan again in micro-batches, priced as such
        plans += predicted(a.model, budget, reqs, ctx,
                           [replace(p, micro=a.micro) for p, _ in plans
                            if p.experts == "cache" and p.micro == 1])
    if not plans:
        raise SystemExit("no plan fits: raise --gpu-budget or give --plans")
    threads = a.threads or os.cpu_count() or 1
    rows = []
    for plan, hrm in plans:
        print(f"plan {plan.label()} ...", flush=True)
        row = run_plan(a.model, a.routing_trace, a.gpu_budget, plan, reqs, ctx, threads)
        if "skipped" in row:
            print(f"  skipped: {row['skipped']}", flush=True)
            continue
        rows.append(row | {"hrm_tokens_per_s": hrm})
    stock = [r for r in rows if r["experts"] == "ncmoe"]
    base = max((r["tokens_per_s"] for r in stock), default=0.0)
    dev = cache_device()
    print(f"\nmodel {a.model.name}, {len(reqs)} requests (scale {a.scale}), context {ctx} a "
          f"sequence, budget {a.gpu_budget}, device {dev.name}, {threads} threads, routing "
          f"{a.routing_trace.name if a.routing_trace else 'the model own'}")
    print("| plan | experts | tokens | wall s | tokens/s | HRM tokens/s | over stock's best "
          "| hit % | H2D GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base > 0 else "-"
        hit = f"{r['hit_rate'] * 100:.1f}" if r["hit_rate"] is not None else "-"
        print(f"| {r['plan']} | {r['policy']} | {r['tokens']} | {r['wall_s']:.2f} "
              f"| {r['tokens_per_s']:.1f} | {r['hrm_tokens_per_s']:.1f} | {ratio} | {hit} "
              f"| {r['h2d_gb']:.2f} |")
    ours = max((r["tokens_per_s"] for r in rows if r["experts"] == "cache"), default=0.0)
    if base > 0 and ours > 0:
        print(f"forecache's best over stock llama.cpp's best: {ours / base:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({
            "model": a.model.name, "requests": len(reqs), "scale": a.scale, "ctx_per_seq": ctx,
            "gpu_budget": a.gpu_budget, "device": dev.name, "threads": threads,
            "machine": platform.machine(), "routing": str(a.routing_trace or ""),
            "rows": rows, "ratio": ours / base if base > 0 and ours > 0 else None}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
