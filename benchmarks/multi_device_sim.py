"""Two cards in simulation: promoe with an expert cache on each device against stock llama.cpp's
best layer split (``--n-cpu-moe N --tensor-split ...``), at the target and at Qwen3-235B-A22B.

    python benchmarks/multi_device_sim.py [--like TRACE.npz]
        [--shapes qwen2-57b-a14b:q4_k,qwen2-57b-a14b:q8_0,qwen3-235b-a22b:q4_k]
        [--budget 24GiB] [--profile rtx3090x2] [--requests 4] [--prefill 512] [--decode 64]
        [--seed 0] [--json OUT]

The machine is the profile's (``devices`` cards of ``--budget`` each, each over its own PCIe link
to one host store). Routing is synthetic, fitted to a real trace (OLMoE-1B-7B: 64 experts, top-8;
at another expert count its statistics are matched scale-free); half of the requests fit the
predictor, the other half are replayed.

* ``ncmoe`` / ``ncmoe-mmap``: stock's best split (``sim.devices.stock_split``): the fewest host
  layers N for which a tensor split fits both cards (llama.cpp's default even split if it does,
  else the layers packed in order); the first N layers' experts in host memory (pinned as
  --no-mmap loads them, or mmap'd), computed on the CPU for small ubatches and copied up to the
  layer's card for ubatches of 32 tokens or more. Ratios are over the faster of the two, figure by
  figure.
* ``promoe``: llama.cpp's default split (even for equal cards); each card's memory left after its
  layers' non-expert weights, KV cache and buffers is its layers' expert slots, filled over its
  own link.

Target (issue 39): promoe's decode at least 1.5x stock's best split at the target
(Qwen2-57B-A14B q4_k). At q4_k the whole model fits two 24 GiB cards, so stock's best split keeps
no expert in host memory; the same shape in q8_0 (56 GiB) is run as the one that does not fit.
Every figure is virtual time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forecache.cache.budget import parse_size
from forecache.cache.cost import Profile
from forecache.gguf.specs import get_spec
from forecache.sim.devices import device_layers, device_slots, layer_devices, stock_split
from forecache.sim.run import (
    NCMOE_BEST,
    buffer_bytes,
    fit_predictor,
    routed_like,
    run_one,
    speedup,
    stock_best,
)
from forecache.sim.shapes import ModelShape, shape_of
from forecache.sim.simulate import SimConfig, SimResult
from forecache.trace.format import Request, TraceFile, TraceInfo

ROOT = Path(__file__).resolve().parents[1]
OLMOE = ROOT.parent / "shared" / "traces" / "olmoe_1b_7b_nf4gemm_decode_4x512.npz"
SHAPES = "qwen2-57b-a14b:q4_k,qwen2-57b-a14b:q8_0,qwen3-235b-a22b:q4_k"
TARGET = ("qwen2-57b-a14b", "q4_k")
DECODE_TARGET = 1.5


def routing(args: argparse.Namespace, name: str) -> tuple[TraceInfo, list[Request],
                                                          list[Request], dict]:
    """Requests at ``name`` routed like ``args.like`` (scale-free when the expert count or
    top-k differs): (trace info, fit, replay, synthesis meta)."""
    spec = get_spec(name)
    with TraceFile(args.like) as tf:
        info = tf.info()
    scale_free = (info.n_expert, info.top_k) != (spec.experts, spec.top_k)
    return routed_like(args.like, name, args, scale_free=scale_free)


def bytes_per_device(r: SimResult, n: int) -> list[float]:
    """GB copied over each card's link."""
    d = r.to_json()
    return [d.get(f"h2d_bytes_dev{i}", 0) / 1e9 for i in range(n)]


def run_shape(args: argparse.Namespace, profile: Profile, name: str, qtype: str) -> dict:
    """Stock's best split (pinned and mmap'd) and promoe at ``name`` in ``qtype``."""
    shape: ModelShape = shape_of(name, qtype)
    n_dev = profile.devices
    budgets = [parse_size(args.budget)] * n_dev
    info, fit, replay, meta = routing(args, name)
    _, pred = fit_predictor("auto", info, fit, 2)
    stock = stock_split(shape, budgets, buffer_bytes(shape))
    even = layer_devices(shape.layers, [float(b) for b in budgets])
    slots = device_slots(shape, even, budgets, buffer_bytes(shape))
    runs = {}
    for p in ("ncmoe", "ncmoe-mmap"):
        cfg = SimConfig(p, stock.n_slots(shape), window=2, seed=args.seed,
                        layer_device=stock.layer_device)
        runs[p] = run_one(replay, shape, profile, cfg, None)
    cfg = SimConfig("promoe", slots, window=2, seed=args.seed, layer_device=tuple(even[:-1]))
    runs["promoe"] = run_one(replay, shape, profile, cfg, pred)
    nc = stock_best(runs)
    pro = runs["promoe"]
    model_gb = (shape.dense_bytes + shape.layers * shape.experts * shape.expert_bytes) / 2**30
    return {
        "shape": name, "qtype": qtype, "model_gib": model_gb,
        "stock": {"n_cpu_moe": stock.n_cpu_moe, "tensor_split": stock.split,
                  "layers": [len(ls) for ls in device_layers(stock.layer_device, n_dev)]},
        "promoe_split": {"layers": [len(ls) for ls in device_layers(even[:-1], n_dev)],
                         "slots": sorted(set(s for s in slots if s))},
        "routing": {k: meta[k] for k in ("fitted_to", "fit", "fit_reached", "seed")},
        "runs": {p: r.to_json() for p, r in runs.items()},
        "h2d_gb_per_device": {p: bytes_per_device(r, n_dev) for p, r in runs.items()},
        "ncmoe_best": nc.to_json(),
        "prefill_x": nc.ttft_s / pro.ttft_s if pro.ttft_s > 0 else None,
        "decode_x": nc.tpot_s / pro.tpot_s if pro.tpot_s > 0 else None,
        "_runs": runs, "_nc": nc,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", type=Path, default=OLMOE)
    ap.add_argument("--shapes", default=SHAPES, help="name:qtype,... (models.yaml names)")
    ap.add_argument("--budget", default="24GiB", help="each card's memory")
    ap.add_argument("--profile", default="rtx3090x2")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not args.like.is_file():
        raise SystemExit(f"{args.like}: no such trace; give --like a real trace")
    profile = Profile.load(args.profile)
    n_dev = profile.devices
    results = []
    for item in args.shapes.split(","):
        name, _, qtype = item.partition(":")
        results.append(run_shape(args, profile, name, qtype or "q4_k"))
    print(f"\nprofile {profile.name}: {n_dev} x {args.budget}, {profile.h2d_gbps:g} GB/s per "
          f"link; routing fitted to {args.like.name}; {args.requests // 2} requests of "
          f"{args.prefill} + {args.decode} tokens replayed")
    print(f"{'shape':<24} {'GiB':>5} {'run':<11} {'split (layers)':<16} {'N':>3} "
          f"{'slots':>7} {'TTFT ms':>9} {'TPOT ms':>8} {'hit %':>6} {'H2D GB per card':>16} "
          f"{'prefill':>8} {'decode':>7}")
    for res in results:
        runs, nc = res["_runs"], res["_nc"]
        label = f"{res['shape']} {res['qtype']}"
        for p, r in runs.items():
            d = r.to_json()
            stock = p != "promoe"
            split = res["stock"]["layers"] if stock else res["promoe_split"]["layers"]
            n_cpu = str(res["stock"]["n_cpu_moe"]) if stock else "-"
            slots = "all" if stock else "/".join(map(str, res["promoe_split"]["slots"]))
            per = "/".join(f"{g:.1f}" for g in res["h2d_gb_per_device"][p])
            print(f"{label:<24} {res['model_gib']:>5.1f} {p:<11} {'/'.join(map(str, split)):<16} "
                  f"{n_cpu:>3} {slots:>7} {r.ttft_s * 1e3:>9.1f} {r.tpot_s * 1e3:>8.2f} "
                  f"{d['hit_rate'] * 100:>6.1f} {per:>16} {speedup(nc.ttft_s, r.ttft_s):>8} "
                  f"{speedup(nc.tpot_s, r.tpot_s):>7}")
    print(f"prefill, decode: speedup over stock's best split (TTFT, TPOT), {NCMOE_BEST}; N: "
          "--n-cpu-moe; slots: promoe's expert slots a layer on each card")
    verdict = {}
    for res in results:
        if (res["shape"], res["qtype"]) == TARGET:
            met = res["decode_x"] is not None and res["decode_x"] >= DECODE_TARGET
            verdict = {"decode_x": res["decode_x"], "target": DECODE_TARGET, "met": met}
            fits = res["stock"]["n_cpu_moe"] == 0
            print(f"target ({TARGET[0]} {TARGET[1]}, decode >= {DECODE_TARGET}x stock's best "
                  f"split): {res['decode_x']:.2f}x, {'met' if met else 'NOT met'}" +
                  ("; the whole model fits the cards (--n-cpu-moe 0): no expert is in host "
                   "memory, so there is nothing for a cache to win" if fits else ""))
    if args.json:
        out = {"profile": profile.name, "devices": n_dev, "budget": args.budget,
               "like": args.like.name, "requests": args.requests, "prefill": args.prefill,
               "decode": args.decode, "target": verdict,
               "shapes": [{k: v for k, v in r.items() if not k.startswith("_")}
                          for r in results]}
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
