"""MoE-Infinity's activation-aware cache (``infinity``) against ncmoe, lru, lfu and promoe, in
simulation: every shared trace at its own model's q4_k shape, and the target.

    python benchmarks/sim_infinity.py [--profile rtx4090] [--fraction 0.55]
        [--rates 0.25,0.4,0.55,0.7,0.85] [--traces DIR] [--target-budget 24GiB] [--json OUT]

Each trace in ../shared/traces (models.yaml trace_models) fits on its first half of requests (the
promoe predictor, the EAM collection and the reuse infinity sizes its layers from) and replays
the rest, at ``--fraction`` of each layer's experts and over the ``--rates`` sweep. The target is
Qwen2-57B-A14B q4_k at a 24 GiB budget with synthetic routing (``trace.synth``, the parameters
fitted to OLMoE's trace, which has the target's expert count and top-k). Two more infinity rows
isolate its slot sizing: ``infinity, even slots`` (the even split) and ``infinity, decay slots``
(MoE-Infinity's layer term as each layer's miss cost). Prints markdown tables, ratios over
ncmoe (stock llama.cpp's --n-cpu-moe at the same expert budget: the faster of its runs with host
experts pinned, ncmoe, and mmap'd, ncmoe-mmap, in each figure), and writes every figure to JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from forecache.cache.cost import Profile
from forecache.predictor.base import Predictor
from forecache.sim.run import (
    NCMOE_BEST,
    fit_predictor,
    infinity_setup,
    run_one,
    slots_for,
    speedup,
    split_requests,
    stock_best,
    trace_shape,
)
from forecache.sim.shapes import ModelShape, shape_of, trace_model_names
from forecache.sim.simulate import SimConfig, SimResult
from forecache.trace.format import Request, TraceFile, TraceInfo, logged_layers
from forecache.trace.synth import OLMOE_FIT, synthesize, write_trace

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("ncmoe", "ncmoe-mmap", "lru", "lfu", "promoe", "infinity")


def compare(fit: Sequence[Request], replay: Sequence[Request], info: TraceInfo, shape: ModelShape,
            profile: Profile, n_slots: int, predictor: Predictor, window: int,
            variants: bool) -> dict[str, SimResult]:
    """Every policy at ``n_slots`` a layer (infinity: the same total, moved by reuse); with
    ``variants``, infinity on the even split and with layer-decay sizing too."""
    layers = logged_layers(replay, info.n_layers)
    base = SimConfig("ncmoe", n_slots, window=window)
    slots, eam = infinity_setup(fit, info, shape, layers, n_slots)
    out = {}
    for p in POLICIES:
        if p == "infinity":
            out[p] = run_one(replay, shape, profile, replace(base, policy=p, n_slots=slots), eam)
        else:
            out[p] = run_one(replay, shape, profile, replace(base, policy=p),
                             predictor if p == "promoe" else None)
    if variants:
        out["infinity, even slots"] = run_one(replay, shape, profile,
                                              replace(base, policy="infinity"), eam)
        decayed, _ = infinity_setup(fit, info, shape, layers, n_slots, decay=True)
        out["infinity, decay slots"] = run_one(replay, shape, profile,
                                               replace(base, policy="infinity", n_slots=decayed),
                                               eam)
    out["_slots"] = [slots[il] for il in layers]  # type: ignore[assignment]
    return out


def table(title: str, runs: dict[str, SimResult]) -> str:
    """A markdown table of ``runs``: TTFT, TPOT, hit rate, ratios over ncmoe (the faster of its
    pinned and mmap'd runs in each figure)."""
    nc = stock_best(runs)
    lines = [f"\n{title}\n", "| policy | TTFT ms | TPOT ms | hit % | TTFT vs ncmoe | "
             "TPOT vs ncmoe |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in runs.items():
        if name.startswith("_"):
            continue
        hit = r.to_json()["hit_rate"] * 100
        lines.append(f"| {name} | {r.ttft_s * 1e3:.1f} | {r.tpot_s * 1e3:.2f} | {hit:.1f} | "
                     f"{speedup(nc.ttft_s, r.ttft_s)} | {speedup(nc.tpot_s, r.tpot_s)} |")
    lines.append(f"\nvs ncmoe: vs {NCMOE_BEST}")
    return "\n".join(lines)


def summary(runs: dict[str, SimResult]) -> dict:
    return {k: (v if k.startswith("_") else v.to_json()) for k, v in runs.items()}


def target(args: argparse.Namespace, profile: Profile) -> tuple[str, dict]:
    """The target at its budget with synthetic routing."""
    shape = shape_of("qwen2-57b-a14b", "q4_k")
    n_tok = args.prefill + args.decode
    reqs = synthesize(OLMOE_FIT, n_layers=shape.layers, n_expert=shape.experts,
                      top_k=shape.top_k, tokens=[n_tok] * args.requests,
                      prefill=[args.prefill] * args.requests, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "target.npz"
        write_trace(path, reqs, {"preset": "qwen2-57b-a14b", "n_expert": shape.experts,
                                 "synth": asdict(OLMOE_FIT)})
        with TraceFile(path) as tf:
            info = tf.info()
            fit, replay = split_requests(tf, 0.5)
    n_slots = slots_for(shape, shape.layers, args.target_budget, None)
    pname, pred = fit_predictor("auto", info, fit, args.window)
    runs = compare(fit, replay, info, shape, profile, n_slots, pred, args.window, True)
    title = (f"target: qwen2-57b-a14b q4_k at {args.target_budget} ({n_slots}/{shape.experts} "
             f"slots a layer), synthetic routing {OLMOE_FIT}, promoe predictor {pname} "
             f"(k={args.window}), {len(replay)} requests of {args.prefill} + {args.decode} "
             "tokens replayed")
    return table(title, runs), {"shape": shape.name, "budget": args.target_budget,
                                "n_slots": n_slots, "predictor": pname, "runs": summary(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--fraction", type=float, default=0.55)
    ap.add_argument("--rates", default="0.25,0.4,0.55,0.7,0.85")
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--target-budget", default="24GiB")
    ap.add_argument("--requests", type=int, default=8, help="target: synthetic requests")
    ap.add_argument("--prefill", type=int, default=512, help="target: prompt tokens a request")
    ap.add_argument("--decode", type=int, default=128, help="target: tokens decoded a request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    rates = [float(x) for x in args.rates.split(",")]
    report: dict = {"profile": profile.name, "fraction": args.fraction, "window": args.window,
                    "traces": []}
    sweep_lines = ["\nsweep: TPOT ms (TTFT ms for a trace without decode rows), ratio over "
                   "ncmoe (the faster of ncmoe and ncmoe-mmap), by cache rate (slots a layer)\n",
                   "| trace | rate | " + " | ".join(POLICIES) + " |",
                   "|---|---:|" + "---:|" * len(POLICIES)]
    for stem in sorted(trace_model_names()):
        path = args.traces / f"{stem}.npz"
        if not path.is_file():
            continue
        with TraceFile(path) as tf:
            info = tf.info()
            shape = trace_shape(path, info, None, "q4_k")
            fit, replay = split_requests(tf, 0.5)
        layers = logged_layers(replay, info.n_layers)
        pname, pred = fit_predictor("auto", info, fit, args.window)
        n_slots = slots_for(shape, len(layers), None, args.fraction)
        runs = compare(fit, replay, info, shape, profile, n_slots, pred, args.window, True)
        print(table(f"{path.name}: {shape.name} q4_k, {n_slots}/{shape.experts} slots a layer "
                    f"(infinity: {runs['_slots']}), promoe predictor {pname} (k={args.window}), "
                    f"{len(replay)} requests replayed", runs), flush=True)
        sweep = []
        for rate in rates:
            n = slots_for(shape, len(layers), None, rate)
            r = compare(fit, replay, info, shape, profile, n, pred, args.window, False)
            key = "tpot_s" if r["ncmoe"].n_decode_tokens else "ttft_s"
            nc = getattr(stock_best(r), key)
            sweep_lines.append(f"| {stem}{'' if key == 'tpot_s' else ' (TTFT)'} | {rate:g} ({n}) | "
                               + " | ".join(f"{getattr(r[p], key) * 1e3:.2f} "
                                            f"({speedup(nc, getattr(r[p], key))})"
                                            for p in POLICIES) + " |")
            sweep.append({"rate": rate, "n_slots": n, "runs": summary(r)})
        report["traces"].append({"trace": path.name, "shape": shape.name, "n_slots": n_slots,
                                 "predictor": pname, "replay_requests": len(replay),
                                 "runs": summary(runs), "sweep": sweep})
    print("\n".join(sweep_lines), flush=True)
    text, report["target"] = target(args, profile)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
