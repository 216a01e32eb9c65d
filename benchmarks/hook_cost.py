"""What the gate hook costs: microseconds per routed layer and its share of decode time, on this
machine's build, and its share of a decode token at the target shape in simulation. promoe decides
one-token gates in C (the decode gate); "promoe (hook)" is the same run with every gate in Python.

    python benchmarks/hook_cost.py [-m MODEL] [--fraction 0.5] [--prompt-len 16] [--gen 128]
        [--prompts 3] [--rounds 3] [--json OUT]

Measured: offload (no hook), lru, promoe and promoe without its prediction thread on the same
prompts in one process, taking turns
``--rounds`` times (this machine's speed drifts); the C cache times each call of the Python hook
(``hook_s``, ``hook_calls``) and of the decode gate (``decode_gate_s``, ``decode_gates``). A
decode-heavy workload (short prompts, long generations), so the gates' share of the run is their
share of decode. Simulated: the Python hook and the decode gate over promoe's TPOT at
Qwen2-57B-A14B q4_k, 24 GiB (``benchmarks/target_sim.py``'s routing), with the rtx4090
profile's costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from forecache.bench import run_policy, workload
from forecache.cache.cost import Profile
from forecache.cache.prefetcher import Features
from forecache.models.default import REFERENCE_MODEL
from forecache.placement.options import CacheConfig
from forecache.sim.run import run_one, slots_for
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig
from forecache.trace import synth

POLICIES = ("offload", "lru", "promoe", "promoe --no-prefetch", "promoe (hook)", "infinity")


def simulated_share() -> dict:
    """Python's share of a promoe decode token at the target, in simulation: the gates that
    call the hook, and the runtime's per-token Python (``token_s``)."""
    profile = Profile.load("rtx4090")
    sh = shape_of("qwen2-57b-a14b", "q4_k")
    reqs = synth.synthesize(synth.OLMOE_FIT, n_layers=sh.layers, n_expert=sh.experts,
                            top_k=sh.top_k, tokens=[160] * 2, prefill=[32] * 2, seed=0)
    n = slots_for(sh, sh.layers, "24GiB", None)
    r = run_one(reqs, sh, profile, SimConfig("promoe", n), None)
    hook = profile.prefetch_hook_s or profile.hook_s
    per_token = r.n_decode_tokens or 1
    # decode's Python: gates the decode gate handed to the hook, and the per-token runtime
    py_gates = r.n_decode_tokens * sh.layers - r.extra["decode_gates_in_c"]
    python_s = py_gates * hook / per_token + profile.token_s
    return {"tpot_s": r.tpot_s, "hook_s": hook, "decode_gate_s": profile.decode_gate_s,
            "layers": sh.layers, "python_gates_per_token": py_gates / per_token,
            "python_s": python_s, "share": python_s / r.tpot_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=REFERENCE_MODEL)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    n_ctx, prompts = workload(args.model, args.prompts, args.prompt_len, args.gen)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for _ in range(args.rounds):
        for pol in POLICIES:
            name, _, off = pol.removesuffix(" (hook)").partition(" --no-")
            cfg = CacheConfig(name) if name == "offload" else \
                CacheConfig(name, cache_fraction=args.fraction, predictor="history",
                            features=Features(prefetch=off != "prefetch"))
            r = run_policy(args.model, cfg, prompts, args.gen, n_ctx=n_ctx, n_threads=None,
                           decode_gate=not pol.endswith("(hook)"))
            s = r["stats"]
            wall = sum(t + p * (args.gen - 1) for t, p in r["per_prompt"])
            runs[pol].append({"tpot_s": r["tpot_s"], "hook_s": s["hook_s"],
                              "hook_calls": s["hook_calls"], "gate_s": s["decode_gate_s"],
                              "gates_in_c": s["decode_gates"], "wall_s": wall})
    print(f"{args.model.name}, {platform.machine()} with {os.cpu_count()} CPUs, cache fraction "
          f"{args.fraction}, {args.prompts} prompts of {args.prompt_len} tokens + {args.gen} "
          f"generated, {args.rounds} rounds (medians)\n")
    print("| policy | TPOT ms | over lru | gates in C | C gate us | hook us per call | "
          "hook share of the run |")
    print("|---|---|---|---|---|---|---|")
    med = {}
    for pol, rs in runs.items():
        tpot = statistics.median(x["tpot_s"] for x in rs)
        per = statistics.median(x["hook_s"] / x["hook_calls"] if x["hook_calls"] else 0.0
                                for x in rs)
        gate = statistics.median(x["gate_s"] / x["gates_in_c"] if x["gates_in_c"] else 0.0
                                 for x in rs)
        in_c = statistics.median(x["gates_in_c"] / (x["gates_in_c"] + x["hook_calls"])
                                 if x["gates_in_c"] + x["hook_calls"] else 0.0 for x in rs)
        share = statistics.median(x["hook_s"] / x["wall_s"] for x in rs)
        med[pol] = {"tpot_s": tpot, "hook_us": per * 1e6, "gate_us": gate * 1e6,
                    "in_c": in_c, "share": share}
    for pol, m in med.items():
        over = m["tpot_s"] / med["lru"]["tpot_s"]
        print(f"| {pol} | {m['tpot_s'] * 1e3:.2f} | {over:.2f}x | {m['in_c']:.0%} | "
              f"{m['gate_us']:.1f} | {m['hook_us']:.0f} | {m['share']:.0%} |")
    sim = simulated_share()
    print(f"\nsimulated, Qwen2-57B-A14B q4_k at 24 GiB (rtx4090): promoe TPOT "
          f"{sim['tpot_s'] * 1e3:.2f} ms; {sim['python_gates_per_token']:.2f} of "
          f"{sim['layers']} gates a token call the hook ({sim['hook_s'] * 1e6:.0f} us), the "
          f"others the decode gate ({sim['decode_gate_s'] * 1e6:.1f} us); Python "
          f"{sim['python_s'] * 1e3:.3f} ms a token = {sim['share']:.1%} of it")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": med, "simulated": sim},
                                        indent=1))


if __name__ == "__main__":
    main()
