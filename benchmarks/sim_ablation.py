"""ProMoE's ablation (Fig. 13/14) and cache-rate sweep (Fig. 17) in simulation, per trace.

    python benchmarks/sim_ablation.py [--profile rtx4090] [--fraction 0.55]
        [--rates 0.25,0.4,0.55,0.7,0.85] [--traces DIR] [--extra TRACE=SHAPE ...] [--json OUT]

Each real trace in ../shared/traces is replayed at its own model's q4_k shape (models.yaml
trace_models); ``--extra`` adds traces such as the reference model's (``T.npz=reference``).
Beside the ablation, stock llama.cpp's --n-cpu-moe at the same expert budget, its host experts
pinned (ncmoe, --no-mmap) and mmap'd (ncmoe-mmap, its default): promoe's speedups are over the
faster of the two in each figure. Prints one table per trace and writes every figure to JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from forecache.cache.cost import Profile
from forecache.cache.prefetcher import Features
from forecache.sim.run import (
    NCMOE_BEST,
    ablation,
    fit_predictor,
    run_ncmoe,
    run_one,
    slots_for,
    speedup,
    split_requests,
    static_profile,
    stock_best,
    trace_shape,
)
from forecache.sim.shapes import trace_model_names
from forecache.sim.simulate import SimConfig
from forecache.trace.format import TraceFile, logged_layers

ROOT = Path(__file__).resolve().parents[1]
SWEPT = ("ncmoe", "ncmoe-mmap", "offload", "lru", "static", "promoe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--fraction", type=float, default=0.55)
    ap.add_argument("--rates", default="0.25,0.4,0.55,0.7,0.85")
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--extra", nargs="*", default=[], help="TRACE.npz=SHAPE")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    jobs = [(args.traces / f"{stem}.npz", None) for stem in sorted(trace_model_names())
            if (args.traces / f"{stem}.npz").is_file()]
    for item in args.extra:
        path, _, shape = item.partition("=")
        jobs.append((Path(path), shape or None))
    report = {"profile": profile.name, "fraction": args.fraction, "window": args.window,
              "traces": []}
    for path, shape_name in jobs:
        with TraceFile(path) as tf:
            info = tf.info()
            shape = trace_shape(path, info, shape_name, "q4_k")
            fit, replay = split_requests(tf, 0.5)
            layers = logged_layers(replay, info.n_layers)
            pname, pred = fit_predictor("auto", info, fit, args.window)
            base = SimConfig("lru", slots_for(shape, len(layers), None, args.fraction),
                             window=args.window, static_profile=static_profile(fit, info))
            runs = ablation(replay, shape, profile, base, pred)
            runs.append(("static", run_one(replay, shape, profile, replace(base, policy="static"),
                                           None)))
            # stock llama.cpp's best at the same expert budget: what every speedup is stated over
            stock = run_ncmoe(replay, shape, profile, base)
            ncmoe = stock_best(stock)
            sweep = []
            for rate in [float(x) for x in args.rates.split(",")]:
                cfg = replace(base, n_slots=slots_for(shape, len(layers), None, rate))
                row = {"rate": rate, "n_slots": cfg.n_slots}
                for pol in ("ncmoe", "ncmoe-mmap", "lru", "static", "promoe"):
                    r = run_one(replay, shape, profile,
                                replace(cfg, policy=pol, features=Features()), pred)
                    row[pol] = {"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "stall_s": r.stall_s}
                r = run_one(replay, shape, profile, replace(cfg, policy="offload"), None)
                row["offload"] = {"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "stall_s": r.stall_s}
                sweep.append(row)
        lru = runs[0][1]
        print(f"\n{path.name}: {shape.name} q4_k, {base.n_slots}/{shape.experts} slots, "
              f"predictor {pname} (k={args.window}), {len(replay)} requests replayed")
        print(f"{'run':<20} {'TTFT ms':>9} {'TPOT ms':>9} {'stall s':>9} {'prefill':>8} "
              f"{'decode':>8} {'stall cut':>9}")
        for label, r in runs:
            print(f"{label:<20} {r.ttft_s * 1e3:>9.1f} {r.tpot_s * 1e3:>9.2f} {r.stall_s:>9.3f} "
                  f"{speedup(lru.ttft_s, r.ttft_s):>8} {speedup(lru.tpot_s, r.tpot_s):>8} "
                  f"{speedup(lru.stall_s, r.stall_s):>9}")
        promoe = runs[-2][1]
        for label, r in stock.items():
            print(f"{label:<20} {r.ttft_s * 1e3:>9.1f} {r.tpot_s * 1e3:>9.2f} {r.stall_s:>9.3f}")
        print(f"promoe over ncmoe: prefill {speedup(ncmoe.ttft_s, promoe.ttft_s)}, decode "
              f"{speedup(ncmoe.tpot_s, promoe.tpot_s)} ({NCMOE_BEST})")
        print(f"{'cache rate':<11}" + "".join(f"{p + ' TTFT/TPOT ms':>28}" for p in SWEPT))
        for row in sweep:
            print(f"{row['rate']:<11}" + "".join(
                f"{row[p]['ttft_s'] * 1e3:>18.1f}/{row[p]['tpot_s'] * 1e3:<9.2f}" for p in SWEPT))
        report["traces"].append({
            "trace": path.name, "shape": shape.name, "n_slots": base.n_slots,
            "predictor": pname, "replay_requests": len(replay),
            "ablation": [{"run": k, **r.to_json()} for k, r in runs],
            **{k: r.to_json() for k, r in stock.items()}, "ncmoe_best": ncmoe.to_json(),
            "sweep": sweep})
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
