"""Decode routing locality of the real traces: what the default placement's guard may assume of
a model it has not measured (``cache/choice.py``'s PRIOR_LOCALITY).

    python benchmarks/guard_prior.py [--traces DIR] [--shares 0.25,0.4,0.55,0.7,0.85] [--json OUT]

For every real trace in ../shared/traces recorded one request at a time (the batched Qwen1.5
trace interleaves 25 requests and is left out), the hit rate of a per-layer LRU cache holding a
share of each layer's experts as one stream replays the requests (decode rows counted; every row
of a trace without decode rows), and its locality: the share of uniform routing's misses that
were hits. The prior must not exceed the lowest.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forecache.cache.budget import fraction_slots
from forecache.cache.choice import PRIOR_LOCALITY, locality
from forecache.trace.format import TraceFile
from forecache.trace.stats import lru_hit_rate

ROOT = Path(__file__).resolve().parents[1]
BATCHED = {"qwen15_moe_a27b_chat_gsm8k25_5layers_batched"}


def single_stream_traces(folder: Path) -> list[Path]:
    """The real traces recorded one request at a time."""
    return [p for p in sorted(folder.glob("*.npz")) if p.stem not in BATCHED]


def trace_localities(path: Path, shares: list[float]) -> list[dict]:
    """LRU hit rate and locality of ``path`` at each slot share."""
    with TraceFile(path) as tf:
        info = tf.info()
        reqs = list(tf.requests())
    decode = any(r.phase is not None and (r.phase == 1).any() for r in reqs)
    out = []
    for share in shares:
        n = fraction_slots(info.n_expert, share)
        hit = lru_hit_rate(reqs, n, 1 if decode else None)
        f = n / info.n_expert
        out.append({"share": f, "n_slots": n, "lru_hit": hit, "locality": locality(hit, f)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--shares", default="0.25,0.4,0.55,0.7,0.85")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shares = [float(x) for x in args.shares.split(",")]
    rows = {p.stem: trace_localities(p, shares) for p in single_stream_traces(args.traces)}
    if not rows:
        raise SystemExit(f"no traces in {args.traces}")
    print("| trace | " + " | ".join(f"share {s}" for s in shares) + " |")
    print("|---|" + "---|" * len(shares))
    for stem, cells in rows.items():
        print(f"| {stem} | " + " | ".join(f"{c['lru_hit']:.3f} ({c['locality']:.2f})"
                                          for c in cells) + " |")
    low = min(c["locality"] for cells in rows.values() for c in cells)
    print(f"\nLRU hit rate (locality); lowest locality {low:.3f}, PRIOR_LOCALITY "
          f"{PRIOR_LOCALITY:.3f}: {'holds' if PRIOR_LOCALITY <= low else 'TOO HIGH'}")
    if args.json:
        args.json.write_text(json.dumps({"traces": rows, "lowest": low,
                                         "prior": PRIOR_LOCALITY}, indent=1))


if __name__ == "__main__":
    main()
