"""MoBiLE (big-little experts) at the target in simulation: decode by little-pass size and
fallback rate, over exact promoe and ncmoe.

    python benchmarks/mobile_sim.py [--like TRACE.npz] [--shape qwen2-57b-a14b] [--budget 24GiB]
        [--profile rtx4090] [--requests 8] [--prefill 512] [--decode 128]
        [--little-k 4,2] [--fallback 0,0.1,0.2,0.3] [--seed 0] [--json OUT]

The routing is target_sim's (synthesized with the parameters fitted to a real trace of the
shape's expert count and top-k). Each decode token runs a little pass over its top ``little-k``
experts (or, "resident", its experts already in slots and its top-1); a share ``fallback`` of
the tokens is recomputed by the big pass, which first prefetches every layer's experts as the
little pass's router output names them. The fallback rate is an input here: which tokens fall
back at a confidence threshold is measured on a real model (issue 20's quality study), not
simulated. Prints decode TPOT and its ratio over exact promoe and over ncmoe (the faster of its
--no-mmap and mmap runs); writes JSON.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from forecache.sim.run import (
    NCMOE_LEGEND,
    run_one,
    speedup,
    target_baselines,
    target_options,
)

ROOT = Path(__file__).resolve().parents[1]
OLMOE = ROOT.parent / "shared" / "traces" / "olmoe_1b_7b_nf4gemm_decode_4x512.npz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target_options(ap, OLMOE)
    ap.add_argument("--little-k", default="4,2,resident",
                    help="little-pass sizes: numbers, or 'resident' (experts in slots + top-1)")
    ap.add_argument("--fallback", default="0,0.1,0.2,0.3")
    args = ap.parse_args()
    t = target_baselines(args)
    shape, profile, replay, pred = t.shape, t.profile, t.replay, t.predictor
    base, nc, exact = t.base, t.ncmoe_best, t.promoe
    print(f"\n{t.header(args)}\n")
    print("| little pass | fallback | big passes | TPOT ms | hit % | over exact promoe | "
          "over ncmoe |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for little in args.little_k.split(","):
        resident = little == "resident"
        k = shape.top_k if resident else int(little)
        for fb in (float(x) for x in args.fallback.split(",")):
            cfg = replace(base, little_k=k, little_resident=resident, fallback=fb)
            r = run_one(replay, shape, profile, cfg, pred).to_json()
            rows.append({"little": little, "fallback": fb, **r})
            label = "resident + top-1" if resident else f"top-{k}"
            share = r["big_passes"] / max(r["little_passes"], 1)
            print(f"| {label} | {fb:.2f} | {share:.3f} | {r['tpot_s'] * 1e3:.2f} | "
                  f"{r['hit_rate'] * 100:.1f} | {speedup(exact.tpot_s, r['tpot_s'])} | "
                  f"{speedup(nc.tpot_s, r['tpot_s'])} |", flush=True)
    print(NCMOE_LEGEND)
    t.write_json(args, rows, "exact")


if __name__ == "__main__":
    main()
