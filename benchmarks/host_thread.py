"""What handing a split layer's host entries to their CPU thread costs (``thread_s`` of the
machine profiles), with the kept thread and with a thread started and joined per projection.

    python benchmarks/host_thread.py [-m MODEL] [--n 2000] [--rounds 5] [--json OUT]

Loads the model with a one-slot-per-layer expert cache (no compute is needed: the handoff is
timed by the C cache's test control ``forecache_cache_host_handoff``), then alternates the two
ways ``--rounds`` times, ``--n`` empty jobs each, and prints the median microseconds per job.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from forecache.llama import Llama
from forecache.models.default import REFERENCE_MODEL
from forecache.native.testing import controls
from forecache.placement.options import CacheConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=REFERENCE_MODEL)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cfg = CacheConfig("lru", slots_per_layer=1)
    with Llama.open(args.model, cache=cfg, n_ctx=256) as llm:
        cache = llm.expert_cache
        assert cache is not None
        times: dict[str, list[float]] = {"kept thread": [], "thread per projection": []}
        for _ in range(args.rounds):
            for label, fresh in (("kept thread", False), ("thread per projection", True)):
                times[label].append(controls().cache_host_handoff(cache.handle, args.n, fresh))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{args.rounds} rounds of {args.n} empty jobs\n")
    print("| way | us per job (median) | rounds |")
    print("|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {med[k] * 1e6:.1f} | " + ", ".join(f"{x * 1e6:.1f}" for x in v) + " |")
    ratio = med["thread per projection"] / med["kept thread"]
    print(f"\nthe kept thread hands a job over {ratio:.1f}x faster")
    if args.json:
        args.json.write_text(json.dumps({"us": {k: [x * 1e6 for x in v] for k, v in
                                                times.items()}, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
