"""The default placement's guard (``cache/choice.py``) against the simulator, on every trace.

    python benchmarks/default_guard.py [--traces DIR] [--profile rtx4090] [--fraction 0.55]
        [--shares 0.25,0.4,0.55,0.7,0.85] [--json OUT]

1. Decode routing locality of the real traces recorded one request at a time (the batched
   Qwen1.5 trace interleaves 25 requests and is left out): the hit rate of a per-layer LRU cache
   holding a share of each layer's experts as one stream replays the requests (decode rows
   counted; every row of a trace without decode rows), and its locality, the share of uniform
   routing's misses that were hits. What the guard assumes of an unmeasured model
   (PRIOR_LOCALITY) must not exceed the lowest.
2. Each real trace at its own q4_k shape (cache fraction ``--fraction``; the first half of the
   requests fits the predictor, the rest is replayed) and the target (Qwen2-57B-A14B q4_k at
   24 GiB, routing synthesized like OLMoE's, as ``target_sim.py``): ncmoe and promoe simulated,
   then the guard's choice from uniform routing, from the locality a trace of the replayed
   requests records (``forecache trace``), and from the hit rate promoe reached in the simulation
   (what a promoe run records).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from forecache.cache.budget import fraction_slots
from forecache.cache.choice import PRIOR, PRIOR_LOCALITY, Evidence, choose, locality
from forecache.cache.cost import CostModel, Profile
from forecache.sim.run import (
    decode_shape,
    fit_predictor,
    run_one,
    slots_for,
    split_requests,
    trace_shape,
)
from forecache.sim.shapes import shape_of, trace_model_names
from forecache.sim.simulate import SimConfig
from forecache.trace import synth
from forecache.trace.format import Request, TraceFile
from forecache.trace.stats import lru_hit_rate

ROOT = Path(__file__).resolve().parents[1]
BATCHED = {"qwen15_moe_a27b_chat_gsm8k25_5layers_batched"}


def _decode_phase(reqs: list[Request]) -> int | None:
    return 1 if any(r.phase is not None and (r.phase == 1).any() for r in reqs) else None


def trace_localities(path: Path, shares: list[float]) -> list[dict]:
    """LRU hit rate and locality of ``path`` at each slot share."""
    with TraceFile(path) as tf:
        info = tf.info()
        reqs = list(tf.requests())
    phase = _decode_phase(reqs)
    out = []
    for share in shares:
        n = fraction_slots(info.n_expert, share)
        hit = lru_hit_rate(reqs, n, phase)
        f = n / info.n_expert
        out.append({"share": f, "n_slots": n, "lru_hit": hit, "locality": locality(hit, f)})
    return out


def guard_case(name: str, shape, replay: list[Request], n_slots: int, profile: Profile,
               pred) -> dict:  # type: ignore[no-untyped-def]
    """ncmoe and promoe simulated on ``replay``, and the guard's three choices."""
    sim = {p: run_one(replay, shape, profile, SimConfig(p, n_slots), pred if p == "promoe"
                      else None) for p in ("ncmoe", "promoe")}
    share = n_slots / shape.experts
    ds, cost = decode_shape(shape, n_slots), CostModel.from_profile(profile, shape.expert)
    pm = sim["promoe"]
    evidence = {
        "uniform": PRIOR,
        "trace": Evidence(locality(lru_hit_rate(replay, n_slots, _decode_phase(replay)), share),
                          "trace"),
        "promoe run": Evidence(locality(pm.hits / max(pm.hits + pm.misses, 1), share), "run"),
    }
    row = {"case": name, "n_slots": n_slots, "experts": shape.experts,
           "sim_ncmoe_tpot_s": sim["ncmoe"].tpot_s, "sim_promoe_tpot_s": pm.tpot_s,
           "sim_faster": "promoe" if pm.tpot_s < sim["ncmoe"].tpot_s else "ncmoe"}
    for key, ev in evidence.items():
        c = choose(ds, profile, cost, ev)
        row[key] = {"locality": ev.locality, "policy": c.policy, "promoe_s": c.promoe_s,
                    "ncmoe_s": c.ncmoe_s}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--fraction", type=float, default=0.55)
    ap.add_argument("--shares", default="0.25,0.4,0.55,0.7,0.85")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shares = [float(x) for x in args.shares.split(",")]
    profile = Profile.load(args.profile)
    paths = [p for p in sorted(args.traces.glob("*.npz")) if p.stem in trace_model_names()]
    if not paths:
        raise SystemExit(f"no traces in {args.traces}")
    rows = {p.stem: trace_localities(p, shares) for p in paths if p.stem not in BATCHED}
    print("Decode routing locality: LRU hit rate (locality) at each share of a layer's experts\n")
    print("| trace | " + " | ".join(f"share {s}" for s in shares) + " |")
    print("|---|" + "---|" * len(shares))
    for stem, cells in rows.items():
        print(f"| {stem} | " + " | ".join(f"{c['lru_hit']:.3f} ({c['locality']:.2f})"
                                          for c in cells) + " |")
    low = min(c["locality"] for cells in rows.values() for c in cells)
    print(f"\nlowest locality {low:.3f}; PRIOR_LOCALITY {PRIOR_LOCALITY:.3f}: "
          f"{'holds' if PRIOR_LOCALITY <= low else 'TOO HIGH'}\n")

    cases = []
    for path in paths:
        with TraceFile(path) as tf:
            info = tf.info()
            shape = trace_shape(path, info, None, "q4_k")
            fit, replay = split_requests(tf, 0.5)
            _, pred = fit_predictor("auto", info, fit, 2)
        n = slots_for(shape, shape.layers, None, args.fraction)
        cases.append(guard_case(path.stem, shape, replay, n, profile, pred))
        print(f"simulated {path.stem}", flush=True)
    target = shape_of("qwen2-57b-a14b", "q4_k")
    reqs = synth.synthesize(synth.OLMOE_FIT, n_layers=target.layers, n_expert=target.experts,
                            top_k=target.top_k, tokens=[640] * 8, prefill=[512] * 8, seed=0)
    reqs = [replace(r, token_ids=None) for r in reqs]
    n = slots_for(target, target.layers, "24GiB", None)
    cases.append(guard_case("target: qwen2-57b-a14b at 24GiB (synthetic)", target, reqs[4:], n,
                            profile, None))
    print("\nThe guard's choice against the simulator's decode (TPOT ms; estimate ratio = "
          "ncmoe / promoe, above 1 promoe is faster)\n")
    print("| case | slots | simulated ncmoe / promoe | faster | uniform | trace | promoe run |")
    print("|---|---|---|---|---|---|---|")
    for r in cases:
        cells = [f"{r[k]['policy']} ({r[k]['ncmoe_s'] / r[k]['promoe_s']:.2f}x, loc "
                 f"{r[k]['locality']:.2f})" for k in ("uniform", "trace", "promoe run")]
        print(f"| {r['case']} | {r['n_slots']}/{r['experts']} | "
              f"{r['sim_ncmoe_tpot_s'] * 1e3:.2f} / {r['sim_promoe_tpot_s'] * 1e3:.2f} | "
              f"{r['sim_faster']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"profile": profile.name, "localities": rows,
                                         "lowest": low, "prior": PRIOR_LOCALITY,
                                         "cases": cases}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
