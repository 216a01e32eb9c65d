"""Mean ACCURACY_i(k) of every predictor on a set of traces (ProMoE Fig. 8, one row per trace).

    .venv/bin/python benchmarks/predictor_accuracy.py ../shared/traces/*.npz \\
        [--trace-model TRACE=MODEL.gguf ...] [--window 1,2,4,8] [--json out.json]

Predictors that a trace cannot feed (no gate inputs, no token ids, no model for skip) are listed
as n/a with the reason. The random-guess level k/E is printed beside each trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from forecache.gguf.header import read_model_file
from forecache.predictor.evaluate import evaluate
from forecache.predictor.registry import PREDICTORS, parse_names
from forecache.trace.format import TraceFile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--predictors", default="all")
    ap.add_argument("--window", default="1,2,4,8")
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--trace-model", action="append", default=[],
                    help="TRACE_NAME=MODEL.gguf: the model of a trace (for the skip predictor)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    names = parse_names(args.predictors)
    windows = [int(x) for x in args.window.split(",")]
    models = dict(kv.split("=", 1) for kv in args.trace_model)
    results = []
    for path in args.traces:
        t0 = time.perf_counter()
        mpath = models.get(path.name)
        with TraceFile(path) as tr:
            info = tr.info()
            res = evaluate(tr, names, windows, folds=args.folds,
                           model=read_model_file(mpath) if mpath else None)
        results.append({"trace": path.name, "seconds": round(time.perf_counter() - t0, 1),
                        "random": info.top_k / info.n_expert, **res.to_json()})
        print(f"[accuracy] {path.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    head = f"{'trace':<52}{'k':>3}{'rand':>7}" + "".join(f"{n:>9}" for n in PREDICTORS
                                                          if n in names)
    print(head)
    print("-" * len(head))
    for r in results:
        for w, k in enumerate(r["windows"]):
            cells = []
            for n in (n for n in PREDICTORS if n in names):
                p = r["predictors"].get(n)
                v = p["mean"][w] if p else None
                cells.append(f"{v:>9.3f}" if v is not None and np.isfinite(v) else f"{'n/a':>9}")
            label = r["trace"] if w == 0 else ""
            print(f"{label:<52}{k:>3}{r['random']:>7.3f}" + "".join(cells))
        for n, why in r["skipped"].items():
            print(f"{'':<52}    n/a {n}: {why}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"[accuracy] wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
