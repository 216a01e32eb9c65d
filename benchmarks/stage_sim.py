"""Stage slots at the target in simulation: prefill and decode by the number of stage slots.

    python benchmarks/stage_sim.py [--like TRACE.npz] [--shape qwen2-57b-a14b] [--budget 24GiB]
        [--profile rtx4090] [--requests 8] [--prefill 512] [--decode 128]
        [--stage 0,4,8,12,18,24,32] [--seed 0] [--json OUT]

The routing is target_sim's (synthesized with the parameters fitted to a real trace of the
shape's expert count and top-k); promoe replays the second half of the requests with each number
of stage slots, taken from the layers' slots as at run time, beside ncmoe at the same budget
(stock llama.cpp's --n-cpu-moe: the faster of its pinned, --no-mmap, and mmap'd runs in each
figure). Prints TTFT against its two floors, TPOT, and both over ncmoe; writes every figure to
JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from forecache.cache.prefetcher import stage_slots
from forecache.sim.run import (
    NCMOE_LEGEND,
    fit_predictor,
    run_ncmoe,
    run_one,
    speedup,
    stock_best,
    target_options,
    target_replay,
)
from forecache.sim.simulate import SimConfig

ROOT = Path(__file__).resolve().parents[1]
OLMOE = ROOT.parent / "shared" / "traces" / "olmoe_1b_7b_nf4gemm_decode_4x512.npz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target_options(ap, OLMOE)
    ap.add_argument("--stage", default="0,4,8,12,18,24,32")
    args = ap.parse_args()
    shape, profile, n_slots, info, fit, replay, _ = target_replay(args)
    default = stage_slots(shape.experts, [n_slots] * shape.layers, streams=True)
    _, pred = fit_predictor("auto", info, fit, 2)
    base = SimConfig("promoe", n_slots, window=2)
    stock = run_ncmoe(replay, shape, profile, base)
    nc = stock_best(stock)
    rows = []
    print(f"\n{args.shape} q4_k at {args.budget} ({n_slots}/{shape.experts} slots a layer before "
          f"the stage's), profile {profile.name}, {len(replay)} requests of {args.prefill} + "
          f"{args.decode} tokens; ncmoe TTFT {nc.ttft_s * 1e3:.1f} ms ({nc.of('ttft_s')[0]}), "
          f"TPOT {nc.tpot_s * 1e3:.2f} ms ({nc.of('tpot_s')[0]}); default stage slots here: "
          f"{default}\n")
    print("| stage slots | TTFT ms | floor / bus floor ms | above them | TPOT ms | prefill over "
          "ncmoe | decode over ncmoe |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.stage.split(",")):
        r = run_one(replay, shape, profile, replace(base, stage_slots=n), pred).to_json()
        rows.append(r)
        mark = " (default)" if n == default else ""
        print(f"| {n}{mark} | {r['ttft_s'] * 1e3:.1f} | {r['floor_ttft_s'] * 1e3:.1f} / "
              f"{r['bus_floor_ttft_s'] * 1e3:.1f} | {speedup(r['ttft_s'], r['floor_ttft_s'])} / "
              f"{speedup(r['ttft_s'], r['bus_floor_ttft_s'])} | {r['tpot_s'] * 1e3:.2f} | "
              f"{speedup(nc.ttft_s, r['ttft_s'])} | {speedup(nc.tpot_s, r['tpot_s'])} |")
    print(f"\n{NCMOE_LEGEND}")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "budget": args.budget,
                                         "profile": profile.name, "n_slots": n_slots,
                                         "default_stage": default,
                                         **{k: v.to_json() for k, v in stock.items()},
                                         "ncmoe_best": nc.to_json(),
                                         "runs": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
