"""Expert matmul rate on the CPU: the file's layout (forecache's host experts) against llama.cpp's
repacked layout (stock --n-cpu-moe's), per weight type, token rows and threads.

    python benchmarks/expert_kernels.py [--preset qwen2-57b-a14b] [--types q4_0,q4_k,q8_0]
        [--rows 1,8,64] [--threads 1,2] [--iters 20] [--rounds 3] [--json OUT]

For each type a one-layer model of ``--preset``'s shape is made; its layer's expert projections are
computed on a CPU backend (``forecache_cache_expert_matmul``: MUL_MAT_ID over the host experts,
each token row routed to the model's top-k distinct experts) from the file's bytes and from a
copy in llama.cpp's CPU repack buffer, taking turns ``--rounds`` times (medians of ``--iters``
computes each). The rate is the routed experts' weight bytes read per second: at one row (a
decode token's misses, what promoe's split sends to the CPU) it shows whether the kernels are
bound by memory (both near the machine's DRAM rate) or by compute (repacking pays).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from forecache.cache.runtime import ExpertCache
from forecache.gguf.maker import make_model
from forecache.llama import Llama
from forecache.native.testing import controls
from forecache.placement.options import CacheConfig


def _seconds(cache: ExpertCache, layer: int, n_proj: int, rows: int, k: int, repacked: bool,
             threads: int, iters: int) -> float:
    """One layer's expert projections for ``rows`` token rows, summed; <0 on failure."""
    total = 0.0
    for p in range(n_proj):
        s = controls().cache_expert_matmul(cache.handle, layer, p, rows, k, repacked, threads,
                                           iters)
        if s < 0:
            return s
        total += s
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-57b-a14b")
    ap.add_argument("--types", default="q4_0,q4_k,q8_0")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows_list = [int(x) for x in args.rows.split(",")]
    threads_list = [int(x) for x in args.threads.split(",")]
    results = []
    print(f"{args.preset} shape, one layer; {platform.machine()} with {os.cpu_count()} CPUs; "
          f"medians of {args.rounds} rounds of {args.iters} computes\n")
    print("| type | rows | threads | file layout GB/s | repacked GB/s | repacked over file |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in args.types.split(","):
            path = Path(tmp) / f"{qtype}.gguf"
            print(f"(making a one-layer {args.preset} model in {qtype})", flush=True)
            make_model(path, args.preset, qtype, seed=0, n_layers=1)
            cfg = CacheConfig("lru", slots_per_layer=1)
            with Llama.open(path, cache=cfg, n_ctx=64) as llm:
                cache = llm.expert_cache
                assert cache is not None
                layer = min(cache.layers)
                info = cache.layers[layer]
                k = llm.model_file.n_expert_used
                n_proj = len(llm.model_file.expert_tensors(layer))
                for rows in rows_list:
                    # distinct experts the rows route to, whose weights the matmul reads
                    touched = min(rows * k, info.n_expert)
                    nbytes = touched * info.expert_bytes
                    for threads in threads_list:
                        times: dict[bool, list[float]] = {False: [], True: []}
                        for _ in range(args.rounds):
                            for rp in (False, True):
                                times[rp].append(_seconds(cache, layer, n_proj, rows, k, rp,
                                                          threads, args.iters))
                        file_s, rep_s = (statistics.median(times[rp]) for rp in (False, True))
                        row = {"type": qtype, "rows": rows, "threads": threads,
                               "bytes": nbytes, "file_s": file_s, "repacked_s": rep_s}
                        results.append(row)
                        if rep_s == -2:
                            rep = "no repacked kernel"
                            ratio = "-"
                        else:
                            rep = f"{nbytes / rep_s / 1e9:.1f}"
                            ratio = f"{file_s / rep_s:.2f}x"
                        print(f"| {qtype} | {rows} | {threads} | {nbytes / file_s / 1e9:.1f} | "
                              f"{rep} | {ratio} |", flush=True)
            path.unlink()
    print("\nrate: the routed experts' weight bytes over the time of their three projections")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "machine": platform.machine(),
                                         "cpus": os.cpu_count(), "runs": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
