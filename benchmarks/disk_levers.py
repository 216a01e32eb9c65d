"""Lossless levers on the disk tier, in simulation, on ``benchmarks/disk_sim.py``'s setup
(Qwen3.5-397B-A17B q4_k, rtx4090 profile, 64 GiB host, 7 GB/s NVMe): promoe as disk_sim.py
runs it against the same with one ``SimConfig`` option changed, over the same fitted routing.

    python benchmarks/disk_levers.py [--like T.npz ...] [--levers exclusive,request,...]
        [--requests 4] [--prefill 128] [--decode 128] [--disk-window 0] [--jobs 1] [--json OUT]

Levers (``LEVERS``): ``exclusive``: exclusive tiers (``SimConfig.host_exclusive``: an expert
copied to the device gives up its host slot first, one leaving the device is written back to a
host slot); ``request``: host eviction by the current request's use counts, then all uses
(``host_evict="request"``, MoE-Infinity's per-request activation counts); ``predicted``: a disk
window prediction counts as a use; ``exclusive+request``: both; ``no-read-ahead``: a predicted
expert's copy reads nothing from the file (``host_read_ahead=False``: only experts already in host
slots are copied ahead, the rest read once routed); ``ordered``: reads served in priority order,
each split in pieces every reader works on, so they end one after another at the full rate
(``disk_ordered``). Every figure is virtual time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from forecache.sim.run import fit_predictor
from forecache.sim.simulate import SimConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_sim import (  # noqa: E402
    FLASH_MOE_TOKS,
    decode_traces,
    machine,
    measure,
    replay_like,
    row,
    setup_args,
)

LEVERS = {
    "exclusive": {"host_exclusive": True},
    "request": {"host_evict": "request"},
    "predicted": {"host_evict": "predicted"},
    "exclusive+request": {"host_exclusive": True, "host_evict": "request"},
    "no-read-ahead": {"host_read_ahead": False},
    "ordered": {"disk_ordered": True},
}


def run_trace(like: Path, args: argparse.Namespace, levers: list[str]) -> dict:
    """promoe and each lever over ``like``'s fitted routing."""
    profile, shape, n_slots, n_host = machine(args)
    fit, replay, info, _ = replay_like(like, args)
    pname, pred = fit_predictor("auto", info, fit, args.window)
    cfg = SimConfig("promoe", n_slots, window=args.window, host_slots=n_host,
                    disk_window=args.disk_window, seed=args.seed)
    runs = {"promoe": row(measure(fit, replay, shape, profile, cfg, pred))}
    for lever in levers:
        runs[lever] = row(measure(fit, replay, shape, profile, replace(cfg, **LEVERS[lever]),
                                  pred))
    print(f"  {like.stem}: " + ", ".join(
        f"{n} {r['tokens_s']:.2f} tok/s {r['disk_reads_per_token']:.1f} reads/tok"
        for n, r in runs.items()), flush=True)
    return {"predictor": pname, "runs": {n: {k: v for k, v in r.items() if k != "per_layer"}
                                         for n, r in runs.items()}}


def main() -> None:
    ap = setup_args(__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--disk-window", type=int, default=0,
                    help="disk_sim.py's chosen window (0 measured best there)")
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--jobs", type=int, default=1, help="traces run at once")
    args = ap.parse_args()
    levers = [x for x in args.levers.split(",") if x]
    for x in levers:
        if x not in LEVERS:
            raise SystemExit(f"unknown lever {x!r}: one of {', '.join(LEVERS)}")
    traces = args.like or decode_traces(args.traces)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            got = list(pool.map(run_trace, traces, [args] * len(traces),
                                [levers] * len(traces)))
    else:
        got = [run_trace(t, args, levers) for t in traces]
    results = {t.stem: g for t, g in zip(traces, got, strict=True)}
    names = ["promoe", *levers]

    def gmean(name: str, key: str = "tokens_s") -> float:
        return math.exp(np.mean([math.log(v["runs"][name][key]) for v in results.values()]))

    print(f"\ndecode tokens/s (reads a token), {args.requests - args.requests // 2} requests of "
          f"{args.prefill} + {args.decode} tokens measured per trace after "
          f"{args.requests // 2} warmed up; disk window {args.disk_window}")
    head = f"{'routing fitted to':<44} " + " ".join(f"{n:>19}" for n in names)
    print(head)
    print("-" * len(head))
    for stem, v in results.items():
        print(f"{stem:<44} " + " ".join(
            f"{v['runs'][n]['tokens_s']:>10.2f} ({v['runs'][n]['disk_reads_per_token']:>6.1f})"
            for n in names))
    means = {n: gmean(n) for n in names}
    print(f"{'geometric mean':<44} " + " ".join(f"{means[n]:>10.2f} {'':>8}" for n in names))
    print(f"flash-moe (published, K=4): {FLASH_MOE_TOKS}; " + ", ".join(
        f"{n} {means[n] / means['promoe']:.2f}x promoe" for n in levers))
    if args.json:
        args.json.write_text(json.dumps({
            "shape": args.shape, "budget": args.budget, "host": args.host,
            "requests": args.requests, "prefill": args.prefill, "decode": args.decode,
            "disk_window": args.disk_window, "levers": {n: LEVERS[n] for n in levers},
            "geomean_tokens_s": means, "traces": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
