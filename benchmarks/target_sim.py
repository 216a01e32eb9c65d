"""The target in simulation: Qwen2-57B-A14B q4_k on a 24 GiB card, every policy over ncmoe.

    python benchmarks/target_sim.py [--like TRACE.npz] [--shape qwen2-57b-a14b] [--budget 24GiB]
        [--profile rtx4090] [--requests 8] [--prefill 512] [--decode 128] [--seed 0]
        [--json OUT]

No public trace routes at the target's shape, so the routing is synthetic: ``synth-trace``'s model
fitted to a real trace of the same expert count and top-k (OLMoE-1B-7B: 64 experts, top-8, as
Qwen2-57B-A14B). Half of the requests fit the predictors, the other half are replayed through
ncmoe (stock llama.cpp's --n-cpu-moe, the bar: host experts pinned as --no-mmap loads them, and
ncmoe-mmap, mmap'd as by default; ratios are over the faster of the two in each figure),
offload, lru, static and promoe at the expert budget the card leaves. Prints the table and
writes every figure to JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from forecache.cache.choice import PRIOR, Evidence, choose, locality
from forecache.cache.cost import CostModel
from forecache.sim.run import (
    NCMOE_BEST,
    decode_shape,
    fit_predictor,
    run_one,
    speedup,
    static_profile,
    stock_best,
    target_options,
    target_replay,
)
from forecache.sim.simulate import SimConfig
from forecache.trace.stats import lru_hit_rate

ROOT = Path(__file__).resolve().parents[1]
OLMOE = ROOT.parent / "shared" / "traces" / "olmoe_1b_7b_nf4gemm_decode_4x512.npz"
POLICIES = ("ncmoe", "ncmoe-mmap", "offload", "lru", "static", "promoe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target_options(ap, OLMOE)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--predictor", default="auto")
    args = ap.parse_args()
    shape, profile, n_slots, info, fit, replay, meta = target_replay(args)
    pname, pred = fit_predictor(args.predictor, info, fit, args.window)
    base = SimConfig("ncmoe", n_slots, window=args.window,
                     static_profile=static_profile(fit, info))
    runs = {p: run_one(replay, shape, profile, replace(base, policy=p),
                       pred if p == "promoe" else None) for p in POLICIES}
    nc = stock_best(runs)
    print(f"\n{args.shape} q4_k at {args.budget} ({n_slots}/{shape.experts} experts per layer in "
          f"device memory), profile {profile.name}, synthetic routing fitted to {args.like.name}, "
          f"predictor {pname} (k={args.window}), {len(replay)} requests of {args.prefill} + "
          f"{args.decode} tokens replayed")
    print(f"{'policy':<10} {'TTFT ms':>9} {'TPOT ms':>9} {'hit %':>6} {'H2D GB':>8} {'stall s':>8} "
          f"{'prefill':>8} {'decode':>8} {'floor TTFT/TPOT ms':>19} {'to floor':>14} "
          f"{'bus floor TTFT':>15} {'to it':>6}")
    for p, r in runs.items():
        d = r.to_json()
        print(f"{p:<10} {r.ttft_s * 1e3:>9.1f} {r.tpot_s * 1e3:>9.2f} "
              f"{d['hit_rate'] * 100:>6.1f} {r.h2d_bytes / 1e9:>8.2f} "
              f"{r.stall_s:>8.3f} {speedup(nc.ttft_s, r.ttft_s):>8} "
              f"{speedup(nc.tpot_s, r.tpot_s):>8} "
              f"{d['floor_ttft_s'] * 1e3:>10.1f}/{d['floor_tpot_s'] * 1e3:<8.2f} "
              f"{speedup(r.ttft_s, d['floor_ttft_s'])}/{speedup(r.tpot_s, d['floor_tpot_s'])} "
              f"{d['bus_floor_ttft_s'] * 1e3:>15.1f} {speedup(r.ttft_s, d['bus_floor_ttft_s']):>6}")
    print(f"prefill, decode: speedup over ncmoe (TTFT, TPOT), {NCMOE_BEST}; floor: the run's "
          "compute with every routed expert resident plus its missed bytes at the host's best "
          "rate (PCIe and CPU together, within DRAM), one after the other; to floor: how far "
          "above it the run is; bus floor: the prompt's missed bytes over PCIe with all "
          "compute hidden under them")
    # the default placement's guard at this shape and budget: uniform routing, then the
    # locality a trace of this routing would record (LRU replay of the replayed decode rows)
    ds = decode_shape(shape, n_slots)
    cost = CostModel.from_profile(profile, shape.expert)
    share = n_slots / shape.experts
    traced = Evidence(locality(lru_hit_rate(replay, n_slots, phase=1), share), "trace",
                      sum(int((r.phase == 1).sum()) for r in replay) * shape.top_k * shape.layers,
                      share=share)
    guard = {}
    faster = "promoe" if runs["promoe"].tpot_s < nc.tpot_s else "ncmoe"
    for name, ev in (("prior", PRIOR), ("trace", traced)):
        c = choose(ds, profile, cost, ev)
        guard[name] = {"policy": c.policy, "promoe_s": c.promoe_s, "ncmoe_s": c.ncmoe_s,
                       "hit": c.hit, "locality": ev.locality}
        print(f"default placement, {name}: {c.reason()}")
    print(f"(simulated above: {faster} decodes faster)")
    if args.json:
        report = {"shape": args.shape, "budget": args.budget, "profile": profile.name,
                  "n_slots": n_slots, "predictor": pname, "window": args.window,
                  "routing": {k: meta[k] for k in ("fitted_to", "params", "targets",
                                                   "fit_reached", "seed")},
                  "replay_requests": len(replay), "prefill": args.prefill,
                  "decode": args.decode,
                  "runs": {p: r.to_json() for p, r in runs.items()},
                  "ncmoe_best": nc.to_json(), "guard": guard}
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
