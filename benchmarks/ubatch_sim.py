"""Where a larger ubatch pays for long prompts, in simulation at the target: Qwen2-57B-A14B q4_k
on a 24 GiB card (rtx4090 profile), ncmoe (host experts pinned, --no-mmap, and mmap'd:
ncmoe-mmap; promoe's ratios are over the faster of the two in each figure) and promoe, prompts
of several lengths, ubatches of 512 and larger.

    python benchmarks/ubatch_sim.py [--prompts 512,2048,8192] [--ubatches 512,1024,2048]
        [--decode 64] [--json OUT]

A ubatch of n tokens makes one pass over the layers: every expert a pass routes and the device
lacks crosses the bus once per pass, so fewer, larger passes move fewer bytes. But llama.cpp
reserves compute buffers for the largest ubatch (all rows' logits, the experts' intermediate
rows; ``cache.budget.compute_buffer_bytes``), which the budget then lacks for expert slots (or for
ncmoe's device layers). Routing is synthesized with the OLMoE-fitted parameters (as
``target_sim.py``), 2 requests per prompt length; promoe runs without a predictor (prefetch adds
nothing at this shape, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forecache.cache.budget import compute_buffer_bytes
from forecache.cache.cost import Profile
from forecache.sim.run import NCMOE_LEGEND, run_one, slots_for, stock_best
from forecache.sim.shapes import ModelShape, shape_of
from forecache.sim.simulate import SimConfig
from forecache.trace import synth

BASE_UBATCH = 512  # what the simulator's fixed budget reserve was sized for
VOCAB = 151936  # Qwen2-57B-A14B's vocabulary


def slots_at(shape: ModelShape, budget: str, n_ubatch: int) -> int:
    """Slots per layer at ``budget`` once a ubatch of ``n_ubatch`` has its buffers."""
    base = slots_for(shape, shape.layers, budget, None)
    extra = (compute_buffer_bytes(n_ubatch, shape.top_k, shape.expert_ff, shape.d_model, VOCAB)
             - compute_buffer_bytes(BASE_UBATCH, shape.top_k, shape.expert_ff, shape.d_model,
                                    VOCAB))
    return max(1, base - -(-extra // (shape.expert_bytes * shape.layers)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--ubatches", default="512,1024,2048")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    shape = shape_of("qwen2-57b-a14b", "q4_k")
    rows = []
    print(f"{shape.name} q4_k at {args.budget}, profile {profile.name}; TTFT ms / TPOT ms\n")
    print("| prompt | ubatch | slots a layer | ncmoe TTFT / TPOT | ncmoe-mmap TTFT / TPOT | "
          "promoe TTFT / TPOT | promoe over ncmoe (prefill, decode) |")
    print("|---|---|---|---|---|---|---|")
    for n_prompt in [int(x) for x in args.prompts.split(",")]:
        reqs = synth.synthesize(synth.OLMOE_FIT, n_layers=shape.layers, n_expert=shape.experts,
                                top_k=shape.top_k, tokens=[n_prompt + args.decode] * 2,
                                prefill=[n_prompt] * 2, seed=0)
        for n_ubatch in [int(x) for x in args.ubatches.split(",")]:
            if n_ubatch > max(n_prompt, BASE_UBATCH):
                continue
            n = slots_at(shape, args.budget, n_ubatch)
            res = {p: run_one(reqs, shape, profile, SimConfig(p, n, n_ubatch=n_ubatch), None)
                   for p in ("ncmoe", "ncmoe-mmap", "promoe")}
            nc, pm = stock_best(res), res["promoe"]
            row = {"prompt": n_prompt, "n_ubatch": n_ubatch, "n_slots": n,
                   **{f"{p}_{k}": getattr(r, k) for p, r in res.items()
                      for k in ("ttft_s", "tpot_s")}}
            rows.append(row)
            cells = " | ".join(f"{res[p].ttft_s * 1e3:.0f} / {res[p].tpot_s * 1e3:.2f}"
                               for p in res)
            print(f"| {n_prompt} | {n_ubatch} | {n} | {cells} | "
                  f"{nc.ttft_s / pm.ttft_s:.2f}x, {nc.tpot_s / pm.tpot_s:.2f}x |", flush=True)
    print(f"\npromoe {NCMOE_LEGEND}")
    if args.json:
        args.json.write_text(json.dumps({"profile": profile.name, "budget": args.budget,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
