"""Placement policies side by side (offload, ncmoe, lru, static): the table in BENCHMARKS.md.

    python benchmarks/policy_bench.py -m MODEL --gpu-budget 24GiB --prompt-len 512 --gen 128 \
        [--policies offload,ncmoe,lru,static] [--routing-trace TRACE] [--json OUT.json]

Besides the policies, all-gpu (every layer on the GPU, no cache) and ncmoe-mmap (--n-cpu-moe
with mmap'd host weights) can be named; ncmoe loads host weights as --no-mmap does, and ratios
"vs ncmoe" take the faster of the two. --routing-trace replays a trace's routing in every run
(the model's own router is computed but not used: meaningful timings on a random-weight model).

A policy name may end in +little or +resident: that policy with MoBiLE's little pass (top half of
the top-k, or the resident experts and the top-1) on every generated token, never the full
model: lossy, the speed bound of --mode mobile; or in +spec: speculative decoding with the
model's little pass as the draft; or in +draft: speculative decoding with the draft model
--draft (ncmoe+draft: stock's best under the same loop). --acceptance replays the drafts'
acceptance (a random-weight model accepts almost nothing: a rate measured for a real pair of
models gives its speed; `benchmarks/spec_sim.py` cites the published ones).

Prints the device, its host-to-device bandwidth and the table; --json also writes the report.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from forecache.bench import format_table, run_bench
from forecache.cache.budget import parse_size
from forecache.cache.registry import POLICIES
from forecache.native.ggml_devices import CopyProbeError, cache_device, measure_copy
from forecache.speculative.acceptance import AcceptanceReplay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, type=Path)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--gpu-budget", default=None)
    ap.add_argument("--cache-fraction", type=float, default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--routing-trace", type=Path, default=None,
                    help="replay this trace's routing in every run")
    ap.add_argument("--acceptance", default=None, metavar="RATE|COUNTS",
                    help="the runs with a draft (e.g. promoe+spec) accept each draft token with "
                         "this probability (e.g. 0.7, as measured for a real pair of models), or "
                         "each verification these counts in turn (e.g. 3,0,2), not as the "
                         "model's logits say: their tokens are meaningless")
    ap.add_argument("--draft", type=Path, default=None, metavar="GGUF",
                    help="the draft model of the runs named with +draft (e.g. "
                         "ncmoe+draft,promoe+draft: stock's best and forecache under the same "
                         "speculative loop); a model draft keeps a replayed routing")
    ap.add_argument("--timeline", action="store_true",
                    help="record and report each cached run's per-layer timeline")
    ap.add_argument("--host-budget", default=None,
                    help="the cached policies with this much host memory: experts beyond it are "
                         "read from the file by the disk tier (stock's runs keep every expert in "
                         "memory)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    a = ap.parse_args()
    try:
        acceptance = AcceptanceReplay.parse(a.acceptance) if a.acceptance else None
    except ValueError as e:
        ap.error(str(e))

    dev = cache_device()
    try:
        bw = measure_copy(dev.index, 256 << 20, 5, pinned=dev.type == "gpu")
        h2d = bw.h2d_gbps
    except CopyProbeError:
        h2d = None
    print(f"device: {dev.name} ({dev.description}), {dev.memory_total / 2**30:.1f} GiB; "
          f"host->device {h2d:.1f} GB/s" if h2d else f"device: {dev.name}", file=sys.stderr)
    t0 = time.time()
    report = run_bench(a.model, [p.strip() for p in a.policies.split(",")],
                       gpu_budget=parse_size(a.gpu_budget) if a.gpu_budget else None,
                       cache_fraction=a.cache_fraction, prompt_len=a.prompt_len, n_gen=a.gen,
                       n_prompts=a.prompts, n_threads=a.threads,
                       routing_trace=a.routing_trace, timeline=a.timeline,
                       host_budget=parse_size(a.host_budget) if a.host_budget else None,
                       acceptance=acceptance, draft_model=a.draft,
                       progress=lambda s: print(s, file=sys.stderr))
    report.update({"device": dev.name, "device_description": dev.description,
                   "h2d_gbps": h2d, "host": platform.node(), "command": " ".join(sys.argv),
                   "date": time.strftime("%Y-%m-%d"), "wall_s": time.time() - t0})
    print(format_table(report))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
