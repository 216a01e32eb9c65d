"""How much llama.cpp's CPU weight repacking speeds up host expert compute, per weight type.

    python benchmarks/repack_gap.py [--preset qwen1.5-moe-a2.7b] [--layers 2]
        [--types q4_0,q4_k,q8_0] [--prompt-len 256] [--gen 32] [--rounds 3] [--json OUT]

forecache loads host experts without repacking (``use_extra_bufts=False``) so slots can be filled
by copying the file's bytes; stock ``--cpu-moe`` / ``--n-cpu-moe`` compute theirs with llama.cpp's
repacked CPU kernels. This measures the gap on this machine's CPU build, where every expert is a
host expert: for each type, a made model of ``--preset``'s shape (``--layers`` layers) runs the
same prompt under llama.cpp's own placement (repacked) and under ``offload`` (the file's layout),
taking turns ``--rounds`` times; prefill (TTFT) and decode (TPOT) medians and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from forecache.generate import SamplingParams, generate
from forecache.gguf.maker import make_model
from forecache.llama import Llama
from forecache.placement.options import CacheConfig


def _run(model: Path, cfg: CacheConfig | None, prompt: list[int], n_gen: int) -> tuple[float,
                                                                                      float]:
    with Llama.open(model, cache=cfg, n_ctx=len(prompt) + n_gen + 8) as llm:
        generate(llm, prompt[:8], 2, SamplingParams(greedy=True), ignore_eos=True)  # warm-up
        r = generate(llm, prompt, n_gen, SamplingParams(greedy=True), ignore_eos=True)
    return r.ttft_s, r.tpot_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--types", default="q4_0,q4_k,q8_0")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_len)]
    ways = {"repacked (llama.cpp's placement)": None, "file layout (offload)":
            CacheConfig("offload")}
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in args.types.split(","):
            path = Path(tmp) / f"{qtype}.gguf"
            make_model(path, args.preset, qtype, seed=0, n_layers=args.layers)
            out[qtype] = {w: [] for w in ways}
            for _ in range(args.rounds):
                for w, cfg in ways.items():
                    out[qtype][w].append(_run(path, cfg, prompt, args.gen))
            path.unlink()
    print(f"{args.preset} shape, {args.layers} layers, {platform.machine()} with "
          f"{os.cpu_count()} CPUs; {args.prompt_len}-token prompt, {args.gen} generated, "
          f"{args.rounds} rounds (medians)\n")
    print("| type | TTFT ms repacked / file layout | prefill gain | TPOT ms repacked / file "
          "layout | decode gain |")
    print("|---|---|---|---|---|")
    summary = {}
    for qtype, runs in out.items():
        (rp, fl) = (runs[w] for w in ways)
        t_r, t_f = (statistics.median(x[0] for x in v) for v in (rp, fl))
        d_r, d_f = (statistics.median(x[1] for x in v) for v in (rp, fl))
        summary[qtype] = {"ttft_repacked": t_r, "ttft_file": t_f, "tpot_repacked": d_r,
                          "tpot_file": d_f}
        print(f"| {qtype} | {t_r * 1e3:.1f} / {t_f * 1e3:.1f} | {t_f / t_r:.2f}x | "
              f"{d_r * 1e3:.2f} / {d_f * 1e3:.2f} | {d_f / d_r:.2f}x |")
    print("\ngain: file layout's time over the repacked one (above 1: repacking is faster)")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": out, "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
