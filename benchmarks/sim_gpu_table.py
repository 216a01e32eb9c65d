"""The simulator next to the GPU: every row of BENCHMARKS.md's H200 tables, simulated.

    python benchmarks/sim_gpu_table.py [--run h200|h100] [--hot-path groups|remap]
        [--prompt-bank] [--rows ...]

Replays what the GPU check (``benchmarks/gpu_check.sh run``, 2026-11-26, NVIDIA H200 with a
16-core Xeon host) measured, on the same routing and the same placement: Qwen2-57B-A14B in
llama.cpp's Q4_K_M mix (28 MoE layers, 64 experts, top-8), slots and ``--n-cpu-moe`` layers as
the runtime's memory plan splits each budget (``cache.budget.split_budget`` over the model's
tensor plan: 1173 slots and 18 stage slots at 24 GiB, 413 and 6 at 12 GiB, 10 and 22 ncmoe host
layers), the routings ``benchmarks/replay_traces.py`` wrote there (seed 0, 512 prompt rows, 80
decode rows) and the shared OLMoE-1B-7B trace mapped onto 28 layers (``trace.replay``). Each run
is simulated as ``policy_bench.py`` ran it then: a warm-up of the prompt's first 8 tokens and one
generated token (it moved both replay cursors, and the measured prompt reused its 8-token KV
prefix, so the timed prompt is one ubatch of 504 rows), then the timed prompt and 63 decode
passes. promoe and infinity predict as the runtime did without trained predictors (history at
window 1; an empty EAM collection at window 2) and plan their host split with the cost model the
runtime measured then started from (``--plan-profile``, default the 4090 profile, with the
device's copy rate; the runtime now plans with ``placement.costs.DEFAULT_GPU_MACHINE`` on a GPU:
``--plan-profile h200-xeon`` simulates that). ``all-gpu`` is ncmoe at a budget that keeps every
layer on the device.

Prints "row | measured TTFT/TPOT | simulated TTFT/TPOT | error %" and writes every figure to
``--json``. The issue's tolerance is 15%.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from forecache.cache.budget import (
    BANK_SHARE_MAX,
    BudgetSplit,
    compute_buffer_bytes,
    parse_size,
)
from forecache.cache.choice import DecodeShape, Evidence, choose_among, locality
from forecache.cache.cost import CostModel, Profile
from forecache.cache.prefetcher import stage_slots
from forecache.cache.registry import policy_spec
from forecache.gguf.header import is_expert_tensor
from forecache.gguf.specs import get_spec, tensor_plan
from forecache.placement.build import EAM_WINDOW
from forecache.placement.costs import DEFAULT_GPU_MACHINE, DEFAULT_MACHINE
from forecache.predictor.base import Predictor
from forecache.predictor.eam import EAMPredictor
from forecache.predictor.history import HistoryPredictor
from forecache.sim.shapes import ModelShape, shape_of
from forecache.sim.simulate import SimConfig, Simulator
from forecache.trace.format import Request
from forecache.trace.replay import Routing, load_routing, map_routing
from forecache.trace.synth import OLMOE_FIT, SynthParams, synthesize

ROOT = Path(__file__).resolve().parents[1]
OLMOE_REAL = ROOT.parent / "shared" / "traces" / "olmoe_1b_7b_nf4gemm_decode_4x512.npz"
TOLERANCE = 0.15

MODEL, QTYPE = "qwen2-57b-a14b", "q4_k_m"
PROMPT, GEN = 512, 64  # gpu_check.sh: one prompt of 512 tokens, 64 generated
DECODE_ROWS = GEN + 16  # the decode rows replay_traces.py wrote (--decode GEN+16)
N_CTX = max(512, PROMPT + GEN + 16)  # bench.workload's context
N_UBATCH = 512
# policy_bench's warm-up then: the prompt's first 8 tokens and 2 generated (one decode pass); the
# timed prompt reuses those 8 tokens' KV (a common prefix), so its one ubatch is the other 504
WARM_PROMPT, WARM_DECODE = 8, 1

# benchmarks/replay_traces.py's TRACES (synth-trace's parameters), seed 0
SYNTH = {
    "uniform": SynthParams(skew=0.0, focus=0.0, stick=0.0, follow=0.0),
    "skewed": SynthParams(skew=2.0, focus=0.2, stick=0.3, follow=0.5),
    "olmoe-fit": OLMOE_FIT,
}


@dataclass(frozen=True)
class Row:
    """One measured row: its table, routing, budget and run, what was measured, and whether it
    was the first run of its process (``policy_bench.py`` call)."""

    label: str
    routing: str
    budget: str
    policy: str  # a simulator policy, or "all-gpu"
    ttft_ms: float
    tpot_ms: float
    first: bool = False
    hit: float | None = None  # measured hit rate %
    h2d_gb: float | None = None


# Measured: BENCHMARKS.md, "GPU: the target on replayed routing (NVIDIA H200), 2026-11-26"
# (gpu_check.sh run at 5ce918b; bench_fit24/fit12/fixed/routings.json). ``first``: the first
# policy of its policy_bench.py call (gpu_check.sh's order), whose timed prompt was the process's
# first 512-token-class ubatch.
MEASURED = (
    Row("fit 24G all-gpu", "olmoe-fit", "64GiB", "all-gpu", 274.2, 7.38, first=True),
    Row("fit 24G ncmoe", "olmoe-fit", "24GiB", "ncmoe", 345.2, 30.26),
    Row("fit 24G ncmoe-mmap", "olmoe-fit", "24GiB", "ncmoe-mmap", 1380.2, 30.73),
    Row("fit 24G promoe", "olmoe-fit", "24GiB", "promoe", 908.2, 22.36, hit=85.8, h2d_gb=35.97),
    Row("fit 24G infinity", "olmoe-fit", "24GiB", "infinity", 898.7, 18.02, hit=89.5,
        h2d_gb=26.75),
    Row("fit 12G ncmoe", "olmoe-fit", "12GiB", "ncmoe", 702.0, 53.81, first=True),
    Row("fit 12G ncmoe-mmap", "olmoe-fit", "12GiB", "ncmoe-mmap", 3233.4, 54.65),
    Row("fit 12G promoe", "olmoe-fit", "12GiB", "promoe", 1508.1, 60.60, hit=50.7,
        h2d_gb=124.85),
    Row("uniform 24G ncmoe", "uniform", "24GiB", "ncmoe", 426.5, 26.36, first=True),
    Row("uniform 24G promoe", "uniform", "24GiB", "promoe", 384.6, 45.23, hit=65.2,
        h2d_gb=93.26),
    Row("skewed 24G ncmoe", "skewed", "24GiB", "ncmoe", 448.8, 28.69, first=True),
    Row("skewed 24G promoe", "skewed", "24GiB", "promoe", 757.5, 18.34, hit=88.8, h2d_gb=28.05),
    Row("real 24G ncmoe", "olmoe-real", "24GiB", "ncmoe", 428.5, 27.46, first=True),
    Row("real 24G promoe", "olmoe-real", "24GiB", "promoe", 741.8, 26.79, hit=82.3,
        h2d_gb=45.31),
    Row("full 64G all-gpu", "olmoe-fit", "64GiB", "all-gpu", 283.6, 7.63, first=True),
    Row("full 64G promoe", "olmoe-fit", "64GiB", "promoe", 165.4, 8.66, hit=100.0, h2d_gb=0.0),
)
# Not simulated: "all-gpu, the model's own (random-weight) routing" (221.0 / 7.27 ms): that
# routing was not recorded.

# Measured: BENCHMARKS.md, "GPU: the check on an H100 (NVIDIA H100 80GB HBM3), 2026-11-26"
# (gpu_check.sh run at 75d2868; benchmarks/gpu/h100-2026-11-26/). Every run warmed up with a
# prompt as long as the timed one (no first-run cost), and promoe's split planned with h200-xeon.
MEASURED_H100 = (
    Row("fit 24G all-gpu", "olmoe-fit", "64GiB", "all-gpu", 147.0, 7.48),
    Row("fit 24G ncmoe", "olmoe-fit", "24GiB", "ncmoe", 371.0, 26.71),
    Row("fit 24G ncmoe-mmap", "olmoe-fit", "24GiB", "ncmoe-mmap", 1303.9, 26.56),
    Row("fit 24G promoe", "olmoe-fit", "24GiB", "promoe", 560.2, 19.53, hit=85.3, h2d_gb=38.68),
    Row("fit 24G infinity", "olmoe-fit", "24GiB", "infinity", 607.9, 16.03, hit=89.2,
        h2d_gb=29.75),
    Row("fit 12G ncmoe", "olmoe-fit", "12GiB", "ncmoe", 576.0, 55.11),
    Row("fit 12G ncmoe-mmap", "olmoe-fit", "12GiB", "ncmoe-mmap", 2967.7, 53.24),
    Row("fit 12G promoe", "olmoe-fit", "12GiB", "promoe", 1117.4, 46.74, hit=50.5,
        h2d_gb=126.92),
    Row("uniform 24G ncmoe", "uniform", "24GiB", "ncmoe", 333.0, 28.27),
    Row("uniform 24G promoe", "uniform", "24GiB", "promoe", 397.3, 37.88, hit=65.1,
        h2d_gb=93.24),
    Row("skewed 24G ncmoe", "skewed", "24GiB", "ncmoe", 342.8, 26.74),
    Row("skewed 24G promoe", "skewed", "24GiB", "promoe", 526.3, 16.79, hit=88.6, h2d_gb=30.15),
    Row("real 24G ncmoe", "olmoe-real", "24GiB", "ncmoe", 323.1, 28.34),
    Row("real 24G promoe", "olmoe-real", "24GiB", "promoe", 494.9, 23.35, hit=82.4,
        h2d_gb=45.89),
    Row("real 24G infinity", "olmoe-real", "24GiB", "infinity", 503.5, 32.96, hit=72.9,
        h2d_gb=84.30),
    Row("full 64G all-gpu", "olmoe-fit", "64GiB", "all-gpu", 151.7, 8.47),
    Row("full 64G promoe", "olmoe-fit", "64GiB", "promoe", 213.0, 8.90, hit=100.0, h2d_gb=0.0),
)


@dataclass(frozen=True)
class Run:
    """One GPU check's rows and how its runs were set up: the warm-up's prompt rows (it moved
    the prompt cursor), the profile promoe's split planned with, and the machine's profile."""

    rows: tuple[Row, ...]
    warm_prompt: int
    plan_profile: str
    profile: str


RUNS = {
    # the warm-up passed 8 prompt tokens; the split planned with the 4090's profile
    "h200": Run(MEASURED, WARM_PROMPT, DEFAULT_MACHINE, "h200-xeon"),
    # a warm-up as long as the prompt (its 512 rows wrap the prompt cursor: the timed prompt
    # replays the same rows); the split planned with h200-xeon (placement.costs.DEFAULT_GPU_MACHINE)
    "h100": Run(MEASURED_H100, PROMPT, DEFAULT_GPU_MACHINE, "h100-xeon"),
}


@dataclass(frozen=True)
class Placement:
    """Slots a layer as the runtime's memory plan gives them (``pre``: before stage slots are
    held back, which is what ncmoe's layers and ``stage_slots`` read) and the stage slots."""

    pre: list[int]
    post: list[int]
    stage: int
    bank_held: int = 0  # prompt banks: experts' worth held back in place of the stage slots

    @property
    def bank(self) -> bool:
        return self.bank_held > 0

    @property
    def held(self) -> int:
        """Experts' worth of device memory held back from the slots."""
        return self.bank_held or self.stage

    def sim_slots(self) -> list[int]:
        """Slots to give the simulator, which takes its stage slots (or prompt banks) one a
        layer from the last cached layers (``Simulator``): ``post`` with those added back, so it
        ends at ``post``."""
        out = list(self.post)
        cached = [il for il, n in enumerate(out) if n > 1]
        for k in range(self.held):
            out[cached[-1 - k % len(cached)]] += 1
        return out


def memory_plan(budget: str) -> BudgetSplit:
    """The runtime's memory plan of ``budget`` for the model, from the tensors make-model writes
    (``split_budget`` reads the same numbers from the file)."""
    spec = get_spec(MODEL)
    plans = tensor_plan(spec, QTYPE)
    per: dict[int, int] = {}
    other = 0
    for t in plans:
        if is_expert_tensor(t.name):
            il = int(t.name.split(".")[1])
            per[il] = per.get(il, 0) + t.nbytes
        else:
            other += t.nbytes
    layers = sorted(per)
    kv = spec.layers * N_CTX * spec.kv_dim * 2 * 2  # f16 K and V, every layer
    plan = BudgetSplit(budget=parse_size(budget), non_expert_bytes=other, kv_bytes=kv,
                      compute_bytes=compute_buffer_bytes(N_UBATCH, spec.top_k, spec.expert_ff,
                                                         spec.d_model, spec.vocab),
                      layer_bytes=tuple(per[il] // spec.experts for il in layers),
                      n_expert=spec.experts, moe_layers=layers)
    return plan


def placement(budget: str, bank: bool = False, bank_share: float = BANK_SHARE_MAX
              ) -> Placement:
    """The runtime's split of ``budget`` for the model (``placement.before.place``); prompt banks
    (``bank``) where they take at most ``bank_share`` of the expert budget (1: wherever they
    fit, as when they are asked for)."""
    spec = get_spec(MODEL)
    plan = memory_plan(budget)
    pre = plan.slots_per_layer()
    if bank and any(n < spec.experts for n in pre):  # as placement.before.held_back on a GPU
        held = plan.bank_held()
        if held * plan.largest_expert_bytes <= plan.expert_budget * bank_share:
            return Placement(pre, plan.slots_per_layer(held=held), 0, held)
    stage = stage_slots(spec.experts, pre, streams=True)
    return Placement(pre, plan.slots_per_layer(held=stage), stage)


def routing(name: str, shape: ModelShape, olmoe_real: Path = OLMOE_REAL) -> Routing:
    """A routing as the GPU run replayed it, mapped onto the model (``trace.replay``)."""
    if name == "olmoe-real":
        if not olmoe_real.is_file():
            raise SystemExit(f"{olmoe_real}: no such trace (the shared OLMoE-1B-7B trace)")
        return load_routing(olmoe_real, n_layers=shape.layers, n_expert=shape.experts,
                            top_k=shape.top_k)
    reqs = synthesize(SYNTH[name], n_layers=shape.layers, n_expert=shape.experts,
                      top_k=shape.top_k, tokens=[PROMPT + DECODE_ROWS], prefill=[PROMPT], seed=0)
    r = reqs[0]
    return map_routing(r.experts, r.weights, r.phase, n_layers=shape.layers,
                       n_expert=shape.experts, top_k=shape.top_k, source=name)


def replayed_requests(rt: Routing, warm_prompt: int = WARM_PROMPT) -> tuple[Request, Request]:
    """(warm-up, timed) as the replay fed them: prompt rows and decode rows each from their own
    cursor (``RoutingReplay.table``), the warm-up's first. A warm-up of ``warm_prompt`` prompt
    tokens; the timed prompt reuses as many as the two share (8 of 512 at WARM_PROMPT: a common
    prefix; none of a whole-length warm-up, the reversed prompt)."""
    cursor = {False: 0, True: 0}

    def take(decode: bool, n: int) -> np.ndarray:
        rows = rt.rows(decode)
        pick = rows[(cursor[decode] + np.arange(n)) % rows.size]
        cursor[decode] = (cursor[decode] + n) % rows.size
        return pick

    def request(n_prompt: int, n_decode: int) -> Request:
        rows = np.r_[take(False, n_prompt), take(True, n_decode)]
        phase = np.r_[np.zeros(n_prompt, np.int8), np.ones(n_decode, np.int8)]
        return Request(experts=rt.experts[rows].astype(np.int16), weights=None, phase=phase)

    warm = request(warm_prompt, WARM_DECODE)
    timed = request(PROMPT - warm_prompt if warm_prompt < PROMPT else PROMPT, GEN - 1)
    return warm, timed


def predictor_for(policy: str, shape: ModelShape) -> tuple[Predictor | None, int]:
    """The predictor and window the runtime ran ``policy`` with
    (``placement.build.make_forecaster``, no trained predictors, no EAM collection)."""
    if policy == "promoe":
        return HistoryPredictor(shape.layers, shape.experts, shape.top_k), 1
    if policy == "infinity":
        return EAMPredictor(shape.layers, shape.experts, shape.top_k, prior_weight=0.0), \
            EAM_WINDOW
    return None, 2


@dataclass
class Simulated:
    ttft_s: float
    tpot_s: float
    hit: float | None
    h2d_gb: float
    host_layers: int
    extra: dict


def simulate_row(row: Row, shape: ModelShape, profile: Profile, plan_profile: Profile | None,
                 routings: dict[str, Routing], warm_prompt: int = WARM_PROMPT,
                 hot_path: str = "groups", prompt_bank: bool = False,
                 bank_share: float = BANK_SHARE_MAX) -> Simulated:
    """One row on the modelled machine, with the runtime's ``hot_path`` (``SimConfig``):
    "groups" is the one the measured rows ran, "remap" today's, with ``prompt_bank`` the
    runtime's default on a GPU since patch version 19 (within ``bank_share`` of the budget)."""
    budget = "64GiB" if row.policy == "all-gpu" else row.budget
    policy = "ncmoe" if row.policy == "all-gpu" else row.policy
    spec = policy_spec(policy, simulated=True)
    bank = prompt_bank and hot_path == "remap" and spec.cached and \
        not spec.policy.routes_every_layer
    pl = placement(budget, bank, bank_share)
    slots = pl.sim_slots() if spec.proactive or pl.bank else pl.pre
    pred, window = predictor_for(policy, shape)
    # the split plans as the runtime's does (placement.costs.split_cost): the default machine's
    # profile with the copy rate probed on the device
    cfg = SimConfig(policy, slots, window=window, n_ubatch=N_UBATCH, plan_profile=plan_profile,
                    hot_path=hot_path, prompt_bank=pl.bank)
    sim = Simulator(shape, profile, cfg, range(shape.layers), pred)
    if spec.proactive or pl.bank:
        # (the simulator takes what is held one slot a layer from the last layers: the same
        # total as the plan's, spread by count where the plan spreads by bytes)
        assert sim.bank == pl.bank and sim.n_stage == pl.stage and \
            sum(sim.n_slots) == sum(pl.post), (sim.bank, sim.n_stage, sim.n_slots)
    warm, timed = replayed_requests(routings[row.routing], warm_prompt)
    sim.run_request(warm)
    hits, misses, h2d = sim.hits, sim.misses, sim.engine.stats["h2d_bytes"]
    host0 = sim.host_layers
    prefill, decode = sim.run_request(timed)
    hits, misses = sim.hits - hits, sim.misses - misses
    cached = spec.cached
    return Simulated(prefill, float(np.mean(decode)),
                     100.0 * hits / (hits + misses) if cached and hits + misses else None,
                     (sim.engine.stats["h2d_bytes"] - h2d) / 1e9, sim.host_layers - host0,
                     {"stall_s": sim.stall, "cpu_s": sim.cpu_s, "runtime_s": sim.runtime_s,
                      "banked_layers": sim.banked})


def error(sim: float, measured: float) -> float:
    return sim / measured - 1.0


def simulate_table(rows: Sequence[Row], profile: Profile, plan_profile: Profile | None = None,
                   olmoe_real: Path = OLMOE_REAL,
                   progress: Callable[[str], None] = lambda s: None,
                   warm_prompt: int = WARM_PROMPT, hot_path: str = "groups",
                   prompt_bank: bool = False) -> list[dict]:
    """Every row simulated: the row's measured and simulated figures and the errors."""
    shape = shape_of(MODEL, QTYPE)
    routings = {name: routing(name, shape, olmoe_real)
                for name in dict.fromkeys(r.routing for r in rows)}
    out = []
    for row in rows:
        t0 = time.perf_counter()
        s = simulate_row(row, shape, profile, plan_profile, routings, warm_prompt, hot_path,
                         prompt_bank)
        progress(f"{row.label}: {time.perf_counter() - t0:.1f} s")
        out.append({"row": row.label, "routing": row.routing, "budget": row.budget,
                    "policy": row.policy, "first_in_process": row.first,
                    "measured_ttft_ms": row.ttft_ms, "measured_tpot_ms": row.tpot_ms,
                    "sim_ttft_ms": s.ttft_s * 1e3, "sim_tpot_ms": s.tpot_s * 1e3,
                    "ttft_error": error(s.ttft_s * 1e3, row.ttft_ms),
                    "tpot_error": error(s.tpot_s * 1e3, row.tpot_ms),
                    "measured_hit": row.hit, "sim_hit": s.hit, "measured_h2d_gb": row.h2d_gb,
                    "sim_h2d_gb": s.h2d_gb, "sim_host_layers": s.host_layers, **s.extra})
    return out


def summary(results: Sequence[dict]) -> dict:
    """Rows within the tolerance, those outside (and in which figure), and how much more the
    first runs of their processes measured than simulated (ms: mean, min, max)."""
    within = {m: sum(abs(r[f"{m}_error"]) <= TOLERANCE for r in results)
              for m in ("ttft", "tpot")}
    outside = []
    for r in results:
        off = [m.upper() for m in ("ttft", "tpot") if abs(r[f"{m}_error"]) > TOLERANCE]
        if off:
            outside.append(f"{r['row']} ({'/'.join(off)})")
    excess = [r["measured_ttft_ms"] - r["sim_ttft_ms"] for r in results if r["first_in_process"]]
    return {"ttft_within": within["ttft"], "tpot_within": within["tpot"], "outside": outside,
            "first_run_excess_ms": (f"{np.mean(excess):.0f} ms on average ({min(excess):.0f} to "
                                    f"{max(excess):.0f})") if excess else "-"}


def format_table(results: Sequence[dict]) -> str:
    lines = [f"{'row':<20} | {'measured TTFT/TPOT ms':>22} | {'simulated TTFT/TPOT ms':>22} | "
             f"{'error % TTFT/TPOT':>18} | {'hit % meas/sim':>14}"]
    for r in results:
        hit = "-" if r["measured_hit"] is None else \
            f"{r['measured_hit']:.1f}/{r['sim_hit']:.1f}"
        mark = "*" if r["first_in_process"] else " "
        lines.append(f"{r['row']:<19}{mark} | {r['measured_ttft_ms']:>11.1f} / "
                     f"{r['measured_tpot_ms']:<8.2f} | {r['sim_ttft_ms']:>11.1f} / "
                     f"{r['sim_tpot_ms']:<8.2f} | {r['ttft_error'] * 100:>+7.1f} / "
                     f"{r['tpot_error'] * 100:<+8.1f} | {hit:>14}")
    return "\n".join(lines)


def default_rows(results: Sequence[dict], profile: Profile, plan_profile: Profile,
                 olmoe_real: Path = OLMOE_REAL, warm_prompt: int = WARM_PROMPT) -> list[dict]:
    """What a run without --policy gets on each routing and budget that has both an ncmoe and a
    promoe row (simulated with today's hot path and prompt banks): the default's choice as the
    runtime makes it from the routing replayed (``placement.before.default_choice``: promoe's own
    placement, then the one with prompt banks the other way, each at the replay's LRU decode
    hit rate at its slots; the planning profile with the machine's copy rate; a 512-row prompt
    ubatch), and the chosen run's simulated TTFT and TPOT over simulated ncmoe's (1.00x where
    it chooses ncmoe; a placement with banks over their default share simulated here)."""
    shape = shape_of(MODEL, QTYPE)
    by = {(r["routing"], r["budget"], r["policy"]): r for r in results}
    cost = CostModel.from_profile(replace(plan_profile, h2d_gbps=profile.h2d_gbps),
                                  shape.expert)
    out = []
    for (name, budget, policy), pm in by.items():
        nc = by.get((name, budget, "ncmoe"))
        if policy != "promoe" or nc is None:
            continue
        plan = memory_plan(budget)
        rt = routing(name, shape, olmoe_real)
        own = pm.get("banked_layers", 0) > 0
        options = []
        for bank, share in ((own, BANK_SHARE_MAX), (not own, 1.0)):
            pl = placement(budget, bank, share)
            if options and pl.bank == own:
                continue  # no other placement
            n_slots = min(pl.post)
            ds = DecodeShape(n_moe=shape.layers, n_expert=shape.experts, top_k=shape.top_k,
                             n_slots=n_slots, ncmoe_host_layers=plan.ncmoe_cpu_layers(),
                             dense_bytes=plan.non_expert_bytes, n_layer=shape.layers,
                             prompt_rows=N_UBATCH, bank=pl.bank)
            hit, lookups = rt.decode_hit_rate(n_slots)
            share_ = n_slots / shape.experts
            options.append((ds, Evidence(locality(hit, share_), "replay", lookups,
                                         share=share_)))
        c = choose_among(options, plan_profile, cost)
        chosen = nc
        if c.policy == "promoe":
            chosen = pm
            if c.alternative:
                row = Row(f"{name} {budget} promoe (default)", name, budget, "promoe", 0.0, 0.0)
                sim = simulate_row(row, shape, profile, plan_profile, {name: rt}, warm_prompt,
                                   "remap", c.shape.bank, 1.0)
                chosen = {"sim_ttft_ms": sim.ttft_s * 1e3, "sim_tpot_ms": sim.tpot_s * 1e3}
        out.append({"routing": name, "budget": budget, "policy": c.policy,
                    "prompt_bank": c.shape.bank, "alternative": c.alternative,
                    "reason": c.reason(), "decode_estimate": c.ncmoe_s / c.promoe_s,
                    "prompt_estimate": c.prompt_ratio(),
                    "ttft_over_ncmoe": nc["sim_ttft_ms"] / chosen["sim_ttft_ms"],
                    "tpot_over_ncmoe": nc["sim_tpot_ms"] / chosen["sim_tpot_ms"],
                    "promoe_ttft_over_ncmoe": nc["sim_ttft_ms"] / pm["sim_ttft_ms"],
                    "promoe_tpot_over_ncmoe": nc["sim_tpot_ms"] / pm["sim_tpot_ms"]})
    return out


def format_defaults(rows: Sequence[dict]) -> str:
    lines = [f"{'routing, budget':<20} | {'chosen':>12} | {'estimate prompt/decode':>22} | "
             f"{'simulated over ncmoe':>20} | {'promoe over ncmoe':>17}"]
    for r in rows:
        est = f"{r['prompt_estimate'] or 0:.2f}x / {r['decode_estimate']:.2f}x"
        pick = r["policy"] + ("+bank" if r["policy"] == "promoe" and r["prompt_bank"] else "")
        lines.append(f"{r['routing'] + ', ' + r['budget']:<20} | {pick:>12} | {est:>22} | "
                     f"{r['ttft_over_ncmoe']:>8.2f}x / {r['tpot_over_ncmoe']:.2f}x | "
                     f"{r['promoe_ttft_over_ncmoe']:>7.2f}x / {r['promoe_tpot_over_ncmoe']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", choices=sorted(RUNS), default="h200",
                    help="which GPU check's rows: the H200's (BENCHMARKS.md 'GPU: the target "
                         "on replayed routing') or the H100's ('GPU: the check on an H100')")
    ap.add_argument("--profile", default=None,
                    help="the machine's profile (default: the run's, h200-xeon or h100-xeon)")
    ap.add_argument("--plan-profile", default=None,
                    help="the profile promoe's host split plans with (default: the one the "
                         "run's measured rows planned with)")
    ap.add_argument("--rows", default=None, help="comma-separated row labels (default: all)")
    ap.add_argument("--hot-path", choices=("groups", "remap"), default="groups",
                    help="the runtime's hot path simulated: the one the measured rows ran "
                         "(groups, the default: the simulator checked against them) or today's "
                         "(remap: predictions for the next GPU run)")
    ap.add_argument("--prompt-bank", action="store_true",
                    help="with --hot-path remap: prompt banks, as the runtime places them on a "
                         "GPU (patch version 19)")
    ap.add_argument("--default", action="store_true",
                    help="also what a run without --policy gets on each routing and budget: "
                         "the default's choice from the routing replayed, simulated over ncmoe")
    ap.add_argument("--olmoe-real", type=Path, default=OLMOE_REAL)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    run = RUNS[a.run]
    rows = run.rows
    if a.rows:
        want = [s.strip() for s in a.rows.split(",")]
        unknown = [w for w in want if w not in {r.label for r in run.rows}]
        if unknown:
            raise SystemExit(f"unknown rows {unknown}; rows: {[r.label for r in run.rows]}")
        rows = tuple(r for r in run.rows if r.label in want)
    profile = Profile.load(a.profile or run.profile)
    plan = Profile.load(a.plan_profile or run.plan_profile)
    results = simulate_table(rows, profile, plan, a.olmoe_real,
                             progress=lambda s: print(s, flush=True),
                             warm_prompt=run.warm_prompt, hot_path=a.hot_path,
                             prompt_bank=a.prompt_bank)
    print(f"\n{MODEL} {QTYPE}, profile {profile.name}, promoe's split planned with "
          f"{plan.name} (copy rate {profile.h2d_gbps} GB/s), hot path {a.hot_path}"
          f"{' with prompt banks' if a.prompt_bank else ''}")
    print(format_table(results))
    s = summary(results)
    print(f"* the first run of its process: its TTFT carries a one-time cost the simulator does "
          f"not model; measured over simulated TTFT there {s['first_run_excess_ms']}")
    print(f"within {TOLERANCE * 100:.0f}%: {s['ttft_within']} of {len(results)} TTFTs, "
          f"{s['tpot_within']} of {len(results)} TPOTs; outside: "
          f"{', '.join(s['outside']) or 'none'}")
    defaults = default_rows(results, profile, plan, a.olmoe_real, run.warm_prompt) \
        if a.default else []
    if defaults:
        print("\nWithout --policy (the default's choice from the routing replayed; ratios over "
              "simulated ncmoe, TTFT / TPOT):")
        print(format_defaults(defaults))
    if a.json:
        a.json.write_text(json.dumps({"run": a.run, "profile": profile.name,
                                      "plan_profile": plan.name,
                                      "tolerance": TOLERANCE, "summary": s, "rows": results,
                                      "defaults": defaults}, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
