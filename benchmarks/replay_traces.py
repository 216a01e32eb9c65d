"""Routing traces to replay on a model (``--routing-trace``): uniform, skewed and fitted to OLMoE.

    python benchmarks/replay_traces.py -m MODEL --out DIR [--prefill 512] [--decode 128]
        [--json OUT.json]

Writes DIR/uniform.npz, DIR/skewed.npz and DIR/olmoe-fit.npz at the model's shape (its MoE
layers, experts and top-k), one request of ``--prefill`` prompt rows and ``--decode`` generated
rows each, from ``synth-trace``'s generative model: uniform routing (every expert alike, no reuse),
a skewed one (a few experts carry most tokens, as a random-weight model routes) and the parameters
fitted to the OLMoE-1B-7B decode trace (64 experts, top-8, as Qwen2-57B-A14B). Prints each trace's
routing statistics (load entropy, top-10% share, reuse) as a table; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from forecache.gguf.header import require_moe
from forecache.trace.format import TraceFile
from forecache.trace.stats import routing_stats
from forecache.trace.synth import OLMOE_FIT, SynthParams, synthesize, write_trace

TRACES = {
    "uniform": SynthParams(skew=0.0, focus=0.0, stick=0.0, follow=0.0),
    "skewed": SynthParams(skew=2.0, focus=0.2, stick=0.3, follow=0.5),
    "olmoe-fit": OLMOE_FIT,
}


def write_traces(model: Path, out: Path, prefill: int, decode: int, seed: int = 0) -> dict:
    """Write the traces of ``TRACES`` for ``model`` into ``out``; returns their statistics."""
    mf = require_moe(model)
    n_layers, n_expert, top_k = len(mf.moe_layers()), mf.n_expert, mf.n_expert_used
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for name, params in TRACES.items():
        reqs = synthesize(params, n_layers=n_layers, n_expert=n_expert, top_k=top_k,
                          tokens=[prefill + decode], prefill=[prefill], seed=seed)
        path = out / f"{name}.npz"
        meta = {"synthetic": True, "params": params.__dict__, "n_expert": n_expert,
                "model": mf.path.name}
        write_trace(path, reqs, meta)
        with TraceFile(path) as tf:
            s = routing_stats(tf).summary()
        report[name] = {"path": str(path), "params": params.__dict__,
                        "load_entropy": s["load_entropy"], "top10_share": s.get("top10_share"),
                        "reuse@1": s["reuse"][1], "reuse@16": s["reuse"][16]}
    return {"model": str(model), "layers": n_layers, "experts": n_expert, "top_k": top_k,
            "prefill": prefill, "decode": decode, "traces": report}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rep = write_traces(a.model, a.out, a.prefill, a.decode)
    print(f"{'trace':<10} {'load entropy':>13} {'top-10% share':>14} {'reuse@1':>8} "
          f"{'reuse@16':>9}")
    for name, r in rep["traces"].items():
        share = f"{r['top10_share']:.3f}" if r["top10_share"] is not None else "-"
        print(f"{name:<10} {r['load_entropy']:>13.3f} {share:>14} {r['reuse@1']:>8.3f} "
              f"{r['reuse@16']:>9.3f}")
    if a.json:
        a.json.write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
