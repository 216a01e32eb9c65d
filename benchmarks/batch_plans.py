"""Batch plans measured: for every plan tried, the roofline model's predicted throughput next to
the measured one; the plan the model picks (``--plan auto``) against the best one measured; and
stock llama.cpp's best batch configuration (its own placement, every sequence count and ubatch
of the grid), all in one run.

    python benchmarks/batch_plans.py [-m MODEL] [--requests 48] [--max-tokens 48]
        [--seqs 1,2,4,8,16] [--ubatches 64,128,512] [--fraction 0.5] [--repeats 3]
        [--threads N] [--json OUT]

Requests are the builtin prompts (cut to 400 characters), greedy. Each placement's profile is
fitted to stage times measured on the model (``forecache.jobs.plan.calibrate``), then every plan
of the grid is predicted and run as ``forecache batch`` runs it (``batch.decode_many``),
``--repeats`` times, the plans taking turns (the median is kept: a machine whose speed drifts
moves every plan alike). "stock"
is llama.cpp's own placement; "cache" is promoe with a device budget that holds ``--fraction``
of the experts at the grid's largest plan. The workload the model is given is the job's: its
prompts' lengths and the answers' lengths as the first run measured them.
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
from forecache.jobs.plan import calibrate, job_workload
from forecache.jobs.requests import Request
from forecache.llama import Llama
from forecache.models.default import ensure_default_model
from forecache.placement.options import Options
from forecache.roofline.batch import BatchPlan, Workload, batch_tokens, estimate, layout
from forecache.roofline.shape import model_shape

PROMPTS = Path(__file__).resolve().parent.parent / "forecache" / "data" / "prompts" / \
    "default.jsonl"
STOCK_BUDGET = 1 << 40  # llama.cpp's own placement: every expert where the weights are


def budget_for(shape: object, work: Workload, plan: BatchPlan, share: float, ne: int) -> int:
    """The smallest budget whose layout of ``plan`` holds ``share`` of each layer's experts."""
    lo, hi = ne, ne + (64 << 30)
    want = max(1, round(share * shape.experts))  # type: ignore[attr-defined]
    while hi - lo > 1 << 16:
        mid = (lo + hi) // 2
        lay = layout(shape, mid, work, plan, ne)  # type: ignore[arg-type]
        if lay is not None and lay.slots >= want:
            hi = mid
        else:
            lo = mid
    return hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seqs", default="1,2,4,8,16")
    ap.add_argument("--ubatches", default="64,128,512")
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    model = a.model or ensure_default_model()
    threads = a.threads or os.cpu_count() or 1
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    greedy = SamplingParams(greedy=True, temperature=0.0)
    reqs = [Request(id=str(i), line=i + 1, prompt=texts[i % len(texts)][:400],
                    max_tokens=a.max_tokens, sampling=greedy) for i in range(a.requests)]
    seqs = [int(x) for x in a.seqs.split(",")]
    ubatches = [int(x) for x in a.ubatches.split(",")]
    grid = [(s, u) for s in seqs for u in ubatches if u >= s]

    def open_plan(cfg: object, n_seq: int, u: int, ctx: int) -> Llama:
        return Llama.open(model, cache=cfg, n_ctx=ctx, n_seq_max=n_seq,  # type: ignore[arg-type]
                          n_threads=threads, n_batch=batch_tokens(n_seq, u), n_ubatch=u)

    def run(llm: Llama, n_seq: int) -> tuple[float, list[dict]]:
        done: list[dict] = []
        t0 = time.perf_counter()
        decode_many(llm, reqs, n_seq, done.append)
        return time.perf_counter() - t0, done

    # the job's lengths: prompts tokenized, answers as a first run gives them
    with open_plan(None, 1, 512, 1024) as llm:
        prompt_lens = [len(llm.tokenize(r.prompt.encode(), add_bos=True, special=True))
                       for r in reqs]
        _, first = run(llm, 1)
    by_id = {r["id"]: r["tokens"] for r in first}
    ctx = max(prompt_lens) + a.max_tokens + 8
    work = job_workload(prompt_lens, [by_id[r.id] for r in reqs], ctx)
    shape = model_shape(llm.model_file)
    mf = llm.model_file
    ne = mf.non_expert_bytes()
    big = BatchPlan(max(seqs), max(ubatches))
    placements = {"stock": (None, STOCK_BUDGET, "ncmoe"),
                  "cache": ("promoe", budget_for(shape, work, big, a.fraction, ne), "cache")}
    print(f"model {model.name}, {a.requests} requests, prompts {work.prompt_len:.0f} and "
          f"answers {work.gen_len:.1f} tokens on average, {threads} threads, "
          f"{platform.processor() or platform.machine()}")
    runs = []  # (placement, cfg, budget, plan, estimate)
    for name, (policy, budget, experts) in placements.items():
        cfg = Options(policy=policy, gpu_budget=budget, predictor="history").cache_config() \
            if policy else None
        with open_plan(cfg, max(seqs), max(ubatches), ctx) as llm:
            profile = calibrate(llm, BatchPlan(max(seqs), max(ubatches), False, experts), budget,
                                progress=print)
        for n_seq, u in grid:
            plan = BatchPlan(n_seq, u, False, experts)
            est = estimate(shape, profile, budget, work, plan, non_expert_bytes=ne)
            if est is not None:
                runs.append((name, cfg, plan, est, profile))
    measured: list[list[float]] = [[] for _ in runs]
    hits: list[float | None] = [None] * len(runs)
    for rep in range(a.repeats):  # the plans take turns
        for i, (_, cfg, plan, _, _) in enumerate(runs):
            with open_plan(cfg, plan.n_seq, plan.n_ubatch, ctx) as llm:
                wall, done = run(llm, plan.n_seq)
                hits[i] = llm.expert_stats()["hit_rate"]
            measured[i].append(sum(r.get("tokens", 0) for r in done) / wall)
        print(f"round {rep + 1}/{a.repeats} measured", flush=True)
    print("\n| placement | sequences | ubatch | slots | predicted tokens/s | measured | error | "
          "bound |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for (name, _, plan, est, profile), got, hit in zip(runs, measured, hits, strict=True):
        tps = float(sorted(got)[len(got) // 2])
        rows.append({"placement": name, "plan": plan.label(), "n_seq": plan.n_seq,
                     "n_ubatch": plan.n_ubatch, "slots": est.slots,
                     "predicted_tps": est.tokens_per_s, "measured_tps": tps,
                     "measured_all": got, "bound": est.bound, "hit_rate": hit,
                     "profile": {k: getattr(profile, k) for k in (
                         "gpu_launch_s", "gpu_mem_gbps", "gpu_tflops", "token_s", "sample_s",
                         "hook_s", "hook_row_s", "decode_gate_s", "group_s", "seq_s",
                         "h2d_gbps")}})
        print(f"| {name} | {plan.n_seq} | {plan.n_ubatch} | {est.slots or '-'} | "
              f"{est.tokens_per_s:.0f} | {tps:.0f} | {est.tokens_per_s / tps - 1:+.0%} | "
              f"{est.bound} |")
    auto = max(rows, key=lambda r: (r["predicted_tps"], r["n_ubatch"]))  # as plans.search
    best = max(rows, key=lambda r: r["measured_tps"])
    stock = max((r for r in rows if r["placement"] == "stock"), key=lambda r: r["measured_tps"])
    worst = max(abs(r["predicted_tps"] / r["measured_tps"] - 1) for r in rows)
    print(f"\nauto: {auto['placement']} {auto['plan']}, measured {auto['measured_tps']:.0f} "
          f"tokens/s = {auto['measured_tps'] / best['measured_tps']:.2f} of the best measured "
          f"({best['placement']} {best['plan']}, {best['measured_tps']:.0f})")
    print(f"stock llama.cpp's best: {stock['plan']}, {stock['measured_tps']:.0f} tokens/s; "
          f"auto over it: {auto['measured_tps'] / stock['measured_tps']:.2f}x")
    print(f"largest prediction error: {worst:.0%}")
    if a.json:
        a.json.write_text(json.dumps({"model": model.name, "threads": threads,
                                      "workload": work.__dict__, "rows": rows,
                                      "auto": auto, "best": best, "stock_best": stock},
                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
