"""Single-token latency of the learned predictor's MLP on one CPU thread (onnxruntime and numpy).

Usage: python benchmarks/predictor_latency.py [--runs N] [--warmup N] [--threads N] [--json OUT]

One onnxruntime session per model shape (intra-op threads 1 by default, batch 1), the hidden width
from ``hidden_size``; weights are random (latency does not depend on their values). ProMoE's
budget is ~200 us per predictor on the CPU; "<= 200 us" is judged on the median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from forecache.predictor.mlp import MLP, OnnxMLP, blas_threads, hidden_size, to_onnx

BUDGET_US = 200.0
# (label, d_model, n_expert, top_k, hidden override: None = hidden_size's rule)
SHAPES: list[tuple[str, int, int, int, int | None]] = [
    ("tiny", 256, 16, 4, None),
    ("Qwen1.5-MoE-A2.7B", 2048, 60, 4, None),
    ("Qwen2-57B-A14B", 3584, 64, 8, None),
    # Reference: ProMoE's ~2M-parameter predictor at DeepSeek-V2-Lite size, without the cap.
    ("ProMoE 2M (ref.)", 2048, 64, 6, 960),
]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else platform's guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def random_mlp(d_model: int, n_expert: int, hidden: int, seed: int = 0) -> MLP:
    """An MLP with He-initialised random weights and identity standardisation."""
    rng = np.random.default_rng(seed)
    return MLP(
        w1=(rng.standard_normal((d_model, hidden)) * np.sqrt(2.0 / d_model)).astype(np.float32),
        b1=np.zeros(hidden, dtype=np.float32),
        w2=(rng.standard_normal((hidden, n_expert)) / np.sqrt(hidden)).astype(np.float32),
        b2=np.zeros(n_expert, dtype=np.float32),
        mean=np.zeros(d_model, dtype=np.float32), scale=np.ones(d_model, dtype=np.float32))


def time_us(fn: object, runs: int, warmup: int) -> np.ndarray:
    """Wall time of each of ``runs`` calls of ``fn()`` after ``warmup`` untimed ones, in us."""
    assert callable(fn)
    for _ in range(warmup):
        fn()
    out = np.empty(runs)
    clock = time.perf_counter_ns
    for i in range(runs):
        t = clock()
        fn()
        out[i] = clock() - t
    return out / 1e3


def summary(us: np.ndarray) -> dict[str, float]:
    """Median, p90 and p99 of latencies in us."""
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99))}


def bench_shape(label: str, d_model: int, n_expert: int, top_k: int, hidden: int | None,
                runs: int, warmup: int, threads: int) -> dict:
    """Latency figures of one shape, onnxruntime and numpy."""
    h = hidden if hidden is not None else hidden_size(d_model, n_expert)
    mlp = random_mlp(d_model, n_expert, h)
    sess = OnnxMLP(to_onnx(mlp).SerializeToString(), threads=threads)
    x = np.random.default_rng(1).standard_normal((1, d_model)).astype(np.float16)
    # What predict() does per token: float16 gate input -> float32 [1, d] -> scores [E].
    ort_us = time_us(lambda: sess.run(x), runs, warmup)
    w1f, b1f = mlp.folded()
    w2, b2 = mlp.w2, mlp.b2
    with blas_threads(threads):
        np_us = time_us(lambda: np.maximum(x.astype(np.float32) @ w1f + b1f, 0.0) @ w2 + b2,
                        runs, warmup)
    ort_s, np_s = summary(ort_us), summary(np_us)
    return {"shape": label, "d_model": d_model, "n_expert": n_expert, "top_k": top_k,
            "hidden": h, "params": mlp.n_params, "first_layer_macs": d_model * h,
            "onnxruntime": ort_s, "numpy": np_s,
            "within_budget": ort_s["median_us"] <= BUDGET_US}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="timed runs per shape")
    ap.add_argument("--warmup", type=int, default=200, help="untimed runs first")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--json", type=Path, help="write the figures and machine info here")
    args = ap.parse_args()

    rows = [bench_shape(*s, runs=args.runs, warmup=args.warmup, threads=args.threads)
            for s in SHAPES]
    head = ("shape", "d_model", "experts", "hidden", "params", "median us", "p90 us", "p99 us",
            "<= 200 us", "numpy median us")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        o = r["onnxruntime"]
        cells = (r["shape"], r["d_model"], r["n_expert"], r["hidden"], f"{r['params']:,}",
                 f"{o['median_us']:.1f}", f"{o['p90_us']:.1f}", f"{o['p99_us']:.1f}",
                 "yes" if r["within_budget"] else "no", f"{r['numpy']['median_us']:.1f}")
        print("| " + " | ".join(str(c) for c in cells) + " |")
    machine = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
               "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(),
               "onnxruntime": ort.__version__, "numpy": np.__version__,
               "python": platform.python_version()}
    print(f"\n{machine['cpu_model']}, {machine['cpus_usable']} CPUs; onnxruntime "
          f"{machine['onnxruntime']}, {args.threads} intra-op thread(s), batch 1, "
          f"{args.runs} runs after {args.warmup} warm-up")
    if args.json:
        report = {"date": time.strftime("%Y-%m-%d"), "machine": machine, "runs": args.runs,
                  "warmup": args.warmup, "threads": args.threads, "budget_us": BUDGET_US,
                  "shapes": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
