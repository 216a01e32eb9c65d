"""Batch jobs at the target in simulation: stock llama.cpp's best batch plan against forecache's.

    python benchmarks/batch_sim.py [--shape qwen2-57b-a14b] [--budget 24GiB] [--profile rtx4090]
        [--requests 1000] [--seed 0] [--pool 16] [--seqs 1,4,16,32,64,128,256,512,1024]
        [--ubatches 128,256,512,1024,2048] [--screen-fill 2] [--widen 2] [--finalists 2]
        [--split simple|equal] [--jobs N] [--quick] [--json OUT]

A job of ``--requests`` chat requests is replayed as ``forecache batch`` runs it (continuous
batching: ``sim.batch.simulate_batch``) under each plan: sequences decoded together, ubatch
size, the KV cache on the device or in host memory (attention then on the CPU), and where the
experts live: stock llama.cpp's ``--n-cpu-moe`` (policy ncmoe: whole layers on the device, the
first layers' experts in host memory, copied up by a ubatch of 32 tokens or more) or forecache's
cache (policy promoe, without a predictor: prefetch adds nothing at this shape, BENCHMARKS.md).
Stock's host experts are pinned, as --no-mmap loads them: mmap'd (llama.cpp's default,
``ncmoe-mmap`` in the simulator) they copy up at the profile's slower pageable rate, which makes
no plan faster unless a profile gives a pageable rate above its pinned one.

Each plan's device memory is the non-expert weights, the KV cache when on the device (every
sequence's context), the compute buffers of its largest ubatch (``cache.budget``), then the
experts: whole layers for ncmoe, slots a layer for promoe; plans that do not fit are left out.
``roofline.batch`` (the hierarchical roofline model, HRM) gives the split and the predicted
tokens/s beside the simulated ones. Stock llama.cpp's plans stop at its 256 sequences a
context; forecache's go to 1,024 (patch 0004).

Batches become ubatches as llama.cpp splits them with a KV stream per sequence, which is how
``forecache batch`` loads the model (``--split equal``, the default): only sequences whose ids
follow each other in the batch share a ubatch, and each layer's attention reads each of a
ubatch's sequences' KV once and computes each row against its own context. ``--split simple``
replays llama.cpp's unified KV cache instead (``--kv-unified``, stock llama.cpp's other choice):
ubatches of ``n_ubatch`` consecutive rows, each row attending over every cell in use.

Workload, assumed: no dataset is downloaded. Prompt and answer lengths are drawn from lognormals
matched to ShareGPT's published means as serving benchmarks cap it (about 161 prompt and 338
answer tokens, prompts at most 1024 tokens, prompt + answer at most 2048: ``sim.run.SHAREGPT``);
the shapes of the distributions are assumed. Routing is synthesized with the parameters fitted
to the OLMoE-1B-7B trace (``trace.synth.OLMOE_FIT``, as ``target_sim.py``); synthesizing every
request would take minutes, so ``--pool`` requests of a whole context are synthesized and each
request routes as a window of one of them at a random offset (``sim.run.window_requests``).

A replay of every plan on the whole job would take hours, so the search narrows as it goes.
Screens first: a plan replays a random ``--screen-fill`` x n_seq of the requests (at least 4)
until none is left to admit and a sequence finishes, which gives its throughput while the batch
is full (``simulate_batch``'s ``steady``); every n_seq,
KV placement and policy at a ubatch of 512, then every ubatch size for the ``--widen`` best of
each policy, and the plan the HRM predicts fastest for each policy over the whole grid (the
one ``forecache batch --plan auto`` would run). Then the whole job, first admission to last
token, for each policy's best screened plan at each of its ``--finalists`` best n_seq (a
screen's full batch flatters the largest n_seq, whose whole job is mostly ramp and tail) and
for the HRM's picks; the best whole job of each policy gives the ratio, and the HRM's pick is
set beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forecache.cache.budget import parse_size
from forecache.cache.choice import locality
from forecache.cache.cost import Profile
from forecache.roofline import batch as hrm
from forecache.roofline.batch import SPLITS
from forecache.sim.batch import simulate_batch
from forecache.sim.run import SHAREGPT, speedup, window_requests
from forecache.sim.shapes import ModelShape, shape_of
from forecache.sim.simulate import SimConfig
from forecache.trace import synth
from forecache.trace.format import Request
from forecache.trace.stats import lru_hit_rate

POLICIES = ("ncmoe", "promoe")
BASE_UBATCH = 512
QUICK = {"seqs": "1,4", "ubatches": "32,128", "requests": 12, "pool": 2, "widen": 1,
         "finalists": 1}


@dataclass(frozen=True)
class Spec:
    """A plan and the policy that places its experts."""

    policy: str
    n_seq: int
    n_ubatch: int
    kv_host: bool
    micro: int = 1  # decode_many's micro-batches (the prompts in micro - 1 contexts of their own)

    def label(self) -> str:
        return (f"seq={self.n_seq},ubatch={self.n_ubatch},kv={'host' if self.kv_host else 'device'}"
                + (f",micro={self.micro}" if self.micro > 1 else ""))

    @classmethod
    def parse(cls, text: str) -> Spec:
        """``POLICY:seq=N,ubatch=U[,kv=host|device][,micro=M]`` (``forecache batch``'s plan)."""
        policy, _, plan = text.partition(":")
        if policy not in POLICIES:
            raise ValueError(f"plan {text!r}: start with one of {', '.join(POLICIES)} and a colon")
        p = hrm.BatchPlan.parse(plan)
        return cls(policy, p.n_seq, p.n_ubatch, p.kv_host, p.micro)


@dataclass
class Placement:
    """Where a plan's budget goes: experts as slots a layer (promoe) or ncmoe's host layers,
    and the HRM's estimate."""

    n_slots: int | list[int]
    experts: str
    predicted: float
    hrm_bound: str


def place(shape: ModelShape, profile: Profile, budget: int, spec: Spec, work: hrm.Workload,
          loc: float) -> Placement | None:
    """``spec``'s expert memory at ``budget`` (the HRM's split for ``work``), or None when it
    does not fit or stock llama.cpp cannot run it (more than its 256 sequences a context)."""
    if spec.policy == "ncmoe" and spec.n_seq > hrm.STOCK_MAX_SEQ:
        return None
    plan = hrm.BatchPlan(spec.n_seq, spec.n_ubatch, spec.kv_host,
                         "ncmoe" if spec.policy == "ncmoe" else "cache", spec.micro)
    # the HRM's figure with the prompt banks the runtime places on a GPU; the replay is given
    # the slots before them (their layout without banks) and holds them back itself, as the
    # runtime does
    lay = hrm.layout(shape, budget, work, plan)
    banked = hrm.estimate(shape, profile, budget, work, plan, locality=loc, bank=True)
    if lay is None or banked is None:
        return None
    slots, host_layers = lay.slots, lay.host_layers
    predicted, bound = banked.tokens_per_s, banked.decode.bound
    if spec.policy == "ncmoe":
        on_gpu = shape.layers - host_layers
        return Placement([shape.experts] * on_gpu + [0] * host_layers,
                         f"--n-cpu-moe {host_layers}", predicted, bound)
    return Placement(int(slots), f"{slots} slots", predicted, bound)


# the job every worker replays: set before the workers fork
_JOB: dict = {}


# (plan, its experts' memory, requests replayed, whole job: else a screen)
Task = tuple[Spec, int | list[int], int, bool]


def _replay(task: Task) -> dict:
    spec, n_slots, n_requests, whole = task
    reqs = _JOB["requests"]
    # a screen: the first ``n_requests`` of a fixed shuffle, in input order
    chosen = sorted(_JOB["order"][:n_requests].tolist())
    cfg = SimConfig(spec.policy, n_slots, n_ubatch=spec.n_ubatch, n_seq=spec.n_seq,
                    kv_host=spec.kv_host, split=_JOB["split"])
    t = time.perf_counter()
    # a screen that admits every request at once has no full batch to measure: it runs whole
    r = simulate_batch([reqs[i] for i in chosen], _JOB["shape"], _JOB["profile"], cfg,
                       steady=not whole and n_requests > spec.n_seq, micro=spec.micro)
    out = r.to_json()
    out["wall_s"] = time.perf_counter() - t
    return out


def run_all(tasks: list[Task], jobs: int) -> list[dict]:
    """Replay ``tasks`` on ``jobs`` processes (forked, sharing the job)."""
    if jobs <= 1 or len(tasks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [_replay(t) for t in tasks]
    # the largest first, so that no worker is left with one at the end
    order = sorted(range(len(tasks)), key=lambda i: (not tasks[i][3], -tasks[i][2]))
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        got = pool.map(_replay, [tasks[i] for i in order], chunksize=1)
    out: list[dict] = [{}] * len(tasks)
    for i, r in zip(order, got, strict=True):
        out[i] = r
    return out


def screen_size(n_seq: int, n_requests: int, fill: int) -> int:
    """Requests of a plan's screen: ``fill`` times its sequences, at least 4."""
    return min(n_requests, max(4, fill * n_seq))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-57b-a14b")
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--requests", type=int, default=None, help="default 1000 (--quick: 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=None,
                    help="synthesized requests the job's routing is cut from (default 16)")
    ap.add_argument("--seqs", default=None,
                    help="n_seq grid (default 1,4,16,32,64,128,256,512,1024)")
    ap.add_argument("--ubatches", default=None, help="n_ubatch grid (default 128,...,2048)")
    ap.add_argument("--screen-fill", type=int, default=2,
                    help="a plan's screen replays this many times its sequences' requests")
    ap.add_argument("--finalists", type=int, default=None,
                    help="n_seq values of each policy whose best plan replays the whole job "
                         "(default 2)")
    ap.add_argument("--widen", type=int, default=None,
                    help="plans of each policy whose every ubatch size is replayed (default 2)")
    ap.add_argument("--split", choices=SPLITS, default="equal",
                    help="the KV cache llama.cpp runs with: equal (a KV stream per sequence, "
                         "as forecache batch loads the model) or simple (a unified cache, "
                         "n_ubatch rows a ubatch, each row attending over every cell in use)")
    ap.add_argument("--micro", type=int, default=1,
                    help="also replay forecache's finalists with this many micro-batches a "
                         "step (2 to 4)")
    ap.add_argument("--plans", default=None,
                    help="replay only these whole jobs, ';'-separated POLICY:PLAN (e.g. "
                         "ncmoe:seq=256,ubatch=512,kv=host;promoe:seq=256,ubatch=512,kv=host,"
                         "micro=2), no search")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="a small grid and job, for tests")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    quick = QUICK if args.quick else {}
    n_req = args.requests or quick.get("requests", 1000)
    seqs = [int(x) for x in
            (args.seqs or quick.get("seqs", "1,4,16,32,64,128,256,512,1024")).split(",")]
    ubatches = [int(x) for x in
                (args.ubatches or quick.get("ubatches", "128,256,512,1024,2048")).split(",")]
    n_pool = args.pool or quick.get("pool", 16)
    widen = args.widen if args.widen is not None else quick.get("widen", 2)
    finalists = args.finalists if args.finalists is not None else quick.get("finalists", 2)
    base_u = BASE_UBATCH if BASE_UBATCH in ubatches else ubatches[-1]
    t_start = time.perf_counter()

    shape = shape_of(args.shape, "q4_k")
    profile = Profile.load(args.profile)
    budget = parse_size(args.budget)
    lengths = SHAREGPT
    ctx = lengths.context
    rng = np.random.default_rng(args.seed)
    prompts, answers = lengths.draw(n_req, rng)
    pool = synth.synthesize(synth.OLMOE_FIT, n_layers=shape.layers, n_expert=shape.experts,
                            top_k=shape.top_k, tokens=[ctx] * n_pool, seed=args.seed + 1)
    requests: list[Request] = window_requests(pool, prompts, answers, rng)
    order = np.random.default_rng(args.seed + 2).permutation(n_req)
    _JOB.update(requests=requests, order=order, shape=shape, profile=profile, split=args.split)
    work = hrm.Workload(n_req, float(prompts.mean()), float(answers.mean()), ctx,
                        tuple(int(a) for a in answers), tuple(int(p) for p in prompts))
    # the routing's decode locality, as a trace of it would record it (cache.choice), at the
    # slots a one-sequence plan gets: what the HRM's hit rate of one sequence rests on
    one = place(shape, profile, budget, Spec("promoe", 1, base_u, False), work, 0.0)
    loc = 0.0
    if one is not None:
        n1 = int(one.n_slots)  # type: ignore[arg-type]
        sample = [requests[i] for i in order[:16]]
        loc = locality(lru_hit_rate(sample, n1, phase=1), n1 / shape.experts)
    print(f"{shape.name} q4_k at {args.budget}, profile {profile.name}: {n_req} requests, "
          f"prompts {prompts.mean():.0f} tokens on average (median {np.median(prompts):.0f}, "
          f"max {prompts.max()}), answers {answers.mean():.0f} (median "
          f"{np.median(answers):.0f}, max {answers.max()}), context {ctx} a sequence; routing "
          f"synthesized ({synth.OLMOE_FIT}), {n_pool} pool requests; decode locality "
          f"{loc:.2f}; ubatches split {args.split}", flush=True)

    placed: dict[Spec, Placement] = {}
    screens: dict[Spec, dict] = {}  # steady throughput of a full batch, on a share of the job
    jobs_: dict[Spec, dict] = {}  # the whole job

    def replay(specs: list[Spec], whole: bool) -> None:
        tasks: list[Task] = []
        for s in dict.fromkeys(specs):
            pl = placed.get(s) or place(shape, profile, budget, s, work, loc)
            if pl is None:  # does not fit
                continue
            placed[s] = pl
            if s not in (jobs_ if whole else screens):
                n = n_req if whole else screen_size(s.n_seq, n_req, args.screen_fill)
                tasks.append((s, pl.n_slots, n, whole))
        t = time.perf_counter()
        for task, r in zip(tasks, run_all(tasks, args.jobs), strict=True):
            (jobs_ if whole else screens)[task[0]] = r
        print(f"{len(tasks)} {'whole jobs' if whole else 'screens'} replayed in "
              f"{time.perf_counter() - t:.0f} s", flush=True)

    def best(policy: str, k: int) -> list[Spec]:
        got = [s for s in screens if s.policy == policy]
        return sorted(got, key=lambda s: -screens[s]["tokens_per_s"])[:k]

    if args.plans:
        given = [Spec.parse(x.strip()) for x in args.plans.split(";") if x.strip()]
        replay(given, True)
        _report_given(given, jobs_, placed, n_req)
        if args.json:
            args.json.write_text(json.dumps({
                "shape": shape.name, "budget": args.budget, "profile": profile.name,
                "requests": n_req, "seed": args.seed, "split": args.split,
                "plans": [{"policy": s.policy, "plan": s.label(),
                           "experts": placed[s].experts if s in placed else None,
                           "hrm_tokens_per_s": placed[s].predicted if s in placed else None,
                           "job": jobs_.get(s)} for s in given],
                "wall_s": time.perf_counter() - t_start}, indent=1))
            print(f"wrote {args.json}")
        return
    # 1. every n_seq and KV placement at the base ubatch
    replay([Spec(p, n, base_u, kv) for p in POLICIES for kv in (False, True) for n in seqs],
           False)
    # 2. every ubatch size for the best of each policy, and the HRM's pick of each policy
    # over the whole grid (what `forecache batch --plan auto` would run)
    picks: dict[str, Spec] = {}
    for p in POLICIES:
        for s in (Spec(p, n, u, kv) for n in seqs for u in ubatches for kv in (False, True)):
            if s not in placed and (pl := place(shape, profile, budget, s, work, loc)):
                placed[s] = pl
        scored = [s for s in placed if s.policy == p]
        if scored:
            picks[p] = max(scored, key=lambda s: (placed[s].predicted, s.n_ubatch))
    replay([Spec(p, s.n_seq, u, s.kv_host) for p in POLICIES for s in best(p, widen)
            for u in ubatches] + list(picks.values()), False)
    # 3. the whole job for each policy's best screened plan at each of its ``--finalists``
    # best n_seq: a screen's full batch flatters the largest n_seq, whose job is mostly
    # ramp and tail
    finals = []
    for p in POLICIES:
        per_seq: dict[int, Spec] = {}
        for s in best(p, len(screens)):
            per_seq.setdefault(s.n_seq, s)
        finals += list(per_seq.values())[:finalists]
    finals += [s for s in picks.values() if s not in finals]
    if args.micro > 1:  # forecache's finalists with micro-batches too
        finals += [Spec(s.policy, s.n_seq, s.n_ubatch, s.kv_host, args.micro) for s in finals
                   if s.policy == "promoe"]
    for s in finals:
        if s.micro > 1 and s not in screens:  # a micro plan's row takes its plan's screen
            base = Spec(s.policy, s.n_seq, s.n_ubatch, s.kv_host)
            if base in screens:
                screens[s] = screens[base]
    replay(finals, True)

    rows = sorted(screens, key=lambda s: (POLICIES.index(s.policy), s not in jobs_,
                                          -jobs_.get(s, screens[s])["tokens_per_s"]))
    print("\n| plan | policy | experts | HRM tokens/s | screen tokens/s | job tokens/s "
          "| pipelined job tokens/s | paged job tokens/s | hit % | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        sc, pl = screens[s], placed[s]
        r = jobs_.get(s, sc)
        job = f"**{r['tokens_per_s']:.1f}**" if s in jobs_ else "-"
        piped = f"{r['overlapped_tokens_per_s']:.1f}" if s in jobs_ else "-"
        paged = f"{r['paged_tokens_per_s']:.1f}" if s in jobs_ and s.policy == "promoe" else "-"
        print(f"| {s.label()} | {s.policy} | {pl.experts} | {pl.predicted:.1f} "
              f"| {sc['tokens_per_s']:.1f} "
              f"({sc['n_requests']}) | {job} | {piped} | {paged} | {r['hit_rate'] * 100:.1f} "
              f"| {r['bound']} |")
    by = {p: max((b for b in finals if b.policy == p and b.micro == 1),
                 key=lambda b: jobs_[b]["tokens_per_s"])
          for p in POLICIES if any(b.policy == p for b in finals)}
    micro_best = max((b for b in finals if b.micro > 1 and b in jobs_),
                     key=lambda b: jobs_[b]["tokens_per_s"], default=None)
    ratio = pipelined = paged_ratio = None
    if len(by) == 2:
        nc, pm = jobs_[by["ncmoe"]], jobs_[by["promoe"]]
        ratio = pm["tokens_per_s"] / nc["tokens_per_s"] if nc["tokens_per_s"] > 0 else None
        print(f"\nforecache's best ({by['promoe'].label()}, {placed[by['promoe']].experts}): "
              f"{pm['tokens_per_s']:.1f} tokens/s; stock llama.cpp's best "
              f"({by['ncmoe'].label()}, {placed[by['ncmoe']].experts}): "
              f"{nc['tokens_per_s']:.1f} tokens/s; "
              f"{speedup(pm['tokens_per_s'], nc['tokens_per_s'])} over the whole job of "
              f"{n_req} requests")

        def best_of(key: str, what: str) -> float | None:
            """forecache's best whole job by ``key``, printed as ``what``; its ratio."""
            at = max((b for b in finals if b.policy == "promoe" and b.micro == 1),
                     key=lambda b: jobs_[b][key])
            got = jobs_[at][key]
            print(f"forecache {what} at its best ({at.label()}): {got:.1f} tokens/s, "
                  f"{speedup(got, nc['tokens_per_s'])} over stock llama.cpp's best")
            return got / nc["tokens_per_s"] if nc["tokens_per_s"] > 0 else None

        pipelined = best_of("overlapped_tokens_per_s", "pipelined")
        paged_ratio = best_of("paged_tokens_per_s", "pipelined with weights paging")
        if micro_best is not None:
            mb = jobs_[micro_best]
            print(f"forecache with micro-batches at its best ({micro_best.label()}): "
                  f"{mb['tokens_per_s']:.1f} tokens/s one pass after another, "
                  f"{speedup(mb['tokens_per_s'], nc['tokens_per_s'])}; "
                  f"{mb['overlapped_tokens_per_s']:.1f} with each round's passes side by side, "
                  f"{speedup(mb['overlapped_tokens_per_s'], nc['tokens_per_s'])} over stock "
                  "llama.cpp's best")
    for p, s in picks.items():
        best_job = by.get(p)
        if best_job is None or s not in jobs_:
            continue
        got, top = jobs_[s]["tokens_per_s"], jobs_[best_job]["tokens_per_s"]
        print(f"the HRM's pick for {p}: {s.label()}, {placed[s].predicted:.1f} tokens/s "
              f"predicted, {got:.1f} replayed ({(placed[s].predicted / got - 1) * 100:+.0f}%); "
              f"the replay's best {best_job.label()}, {top:.1f}"
              + (" (the same plan)" if s == best_job else f" ({got / top:.2f}x of it)"))
    print("screen: generated tokens a second while the batch is full, on a random share of "
          "the requests (how many in brackets), stopped once none is left to admit and a "
          "sequence finishes; "
          "job: over the whole job, first admission to last token (its tail of a few long "
          "answers included); hit % and bound of the job where replayed, else of the screen; "
          "bound: what the critical path spent most time on (GPU: the device's compute; CPU: "
          "experts and attention on the host; PCIe: waiting for copies; runtime: the "
          "runtime's own steps); HRM: roofline.batch's prediction for the whole job; "
          "pipelined: the same replay with each step's device, CPU and bus time side by side "
          "(the busiest of them, the bus busy for every byte it copied), what micro-batches "
          "pipelined over the same cache could reach; paged: pipelined, and each step's "
          "ubatches through each layer before the next, one fill of its prompt bank serving "
          "them all (MoE-Lightning's weights paging)")
    wall = time.perf_counter() - t_start
    print(f"{len(screens)} plans screened, {len(jobs_)} replayed whole, in {wall:.0f} s")
    if args.json:
        report = {
            "shape": shape.name, "budget": args.budget, "profile": profile.name,
            "requests": n_req, "seed": args.seed, "lengths": lengths.__dict__,
            "prompt_mean": float(prompts.mean()), "answer_mean": float(answers.mean()),
            "routing": {"params": synth.OLMOE_FIT.__dict__, "pool": n_pool},
            "locality": loc, "split": args.split, "wall_s": wall,
            "plans": [{"policy": s.policy, "n_seq": s.n_seq, "n_ubatch": s.n_ubatch,
                       "kv_host": s.kv_host, "experts": placed[s].experts,
                       "hrm_tokens_per_s": placed[s].predicted,
                       "hrm_bound": placed[s].hrm_bound, "screen": screens[s],
                       "job": jobs_.get(s)} for s in rows],
            "best": {p: b.label() for p, b in by.items()},
            "hrm_pick": {p: b.label() for p, b in picks.items()}, "ratio": ratio,
            "pipelined_ratio": pipelined, "paged_ratio": paged_ratio}
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


def _report_given(given: list[Spec], jobs_: dict[Spec, dict], placed: dict[Spec, Placement],
                  n_req: int) -> None:
    """The table of ``--plans``' whole jobs, each against the first ncmoe plan's."""
    base = next((jobs_[s] for s in given if s.policy == "ncmoe" and s in jobs_), None)
    print("\n| plan | policy | experts | HRM tokens/s | job tokens/s | HRM error | pipelined "
          "tokens/s | vs stock (job, pipelined) | hit % | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in given:
        if s not in jobs_:
            print(f"| {s.label()} | {s.policy} | does not fit | - | - | - | - | - | - | - |")
            continue
        r = jobs_[s]
        vs = "-" if base is None else \
            (f"{speedup(r['tokens_per_s'], base['tokens_per_s'])}, "
             f"{speedup(r['overlapped_tokens_per_s'], base['tokens_per_s'])}")
        hrm_s = placed[s].predicted
        print(f"| {s.label()} | {s.policy} | {placed[s].experts} | {hrm_s:.1f} "
              f"| {r['tokens_per_s']:.1f} | {hrm_s / r['tokens_per_s'] - 1:+.0%} "
              f"| {r['overlapped_tokens_per_s']:.1f} | {vs} | {r['hit_rate'] * 100:.1f} "
              f"| {r['bound']} |")
    print(f"whole jobs of {n_req} requests; pipelined: each step's (micro-batches: each round's) "
          "device, CPU and bus time side by side")


if __name__ == "__main__":
    main()
