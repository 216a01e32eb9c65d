"""Speculative decoding on the trained reference model: acceptance and speed by draft.

    python benchmarks/spec_bench.py [--prompts 6] [--prompt-len 64] [--gen 64]
        [--drafts self-little,self-cached] [--draft-model GGUF] [--first-layers 1,2,4]
        [--ks 2,4,adaptive] [--temp 0] [--cache-fraction 0.5] [--threads 2] [--json OUT]

Prompts are cut from the reference model's held-out text (``forecache-ref-valid.txt``). Every
run decodes the same prompts with promoe at ``--cache-fraction``: once without a draft, then with
each draft and draft length. Printed per run: the share of drafted tokens the model accepted, the
tokens each verification pass yields (accepted + 1), for a GGUF draft of the model's width the
precision and recall of the experts its states named (through the model's routers) against those
the verifications routed (and the precision a random guess would have), the time per generated
token and the speedup over the run without a draft, and whether the tokens equal it (greedy).
``--first-layers`` also drafts with the reference model's own first N layers (``forecache
make-draft``, written to a temporary directory), whose states the predictor reads layer for layer.
The acceptance feeds the simulator's speculative replay (``spec_sim.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from forecache.generate import SamplingParams, generate
from forecache.gguf.truncate import make_draft
from forecache.llama import Llama
from forecache.models.default import REFERENCE_MODEL
from forecache.placement.options import CacheConfig

VALID = REFERENCE_MODEL.with_name("forecache-ref-valid.txt")


def _prompts(n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, evenly spaced through the held-out text."""
    with Llama.open(REFERENCE_MODEL, cache=None, n_ctx=64) as llm:
        ids = llm.tokenize(VALID.read_bytes(), add_bos=False, special=False)
    step = max((len(ids) - length) // max(n, 1), 1)
    return [ids[i * step:i * step + length] for i in range(n)]


def _run(prompts: list[list[int]], n_gen: int, sp: SamplingParams, cache_fraction: float,
         threads: int, draft: str | None, k: int | None) -> dict:
    cfg = CacheConfig("promoe", cache_fraction=cache_fraction, predictor="history")
    with Llama.open(REFERENCE_MODEL, cache=cfg, n_ctx=len(prompts[0]) + n_gen + 32,
                    n_threads=threads, draft=draft, draft_k=k) as llm:
        generate(llm, prompts[0][:8], 2, sp, ignore_eos=True)  # warm-up
        llm.reset_stats()
        tokens, t_gen, n = [], 0.0, 0
        for p in prompts:
            t0 = time.perf_counter()
            res = generate(llm, p, n_gen, sp, ignore_eos=True)
            # decode time: from the first token to the last
            t_gen += time.perf_counter() - t0 - res.ttft_s
            n += len(res.tokens) - 1
            tokens.append(res.tokens)
        stats = llm.expert_stats()
    return {"tokens": tokens, "tpot_s": t_gen / max(n, 1), "stats": stats}


def _first_layers(draft: str) -> int | None:
    """N for a draft that is a model's own first N layers (its forecache.draft keys)."""
    if not draft.endswith(".gguf"):
        return None
    from forecache.gguf.header import read_model_file
    from forecache.gguf.truncate import declared_first_layers

    declared = declared_first_layers(read_model_file(draft).kv)
    return declared[0] if declared else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--drafts", default="self-little,self-cached")
    ap.add_argument("--draft-model", default=None, help="also a GGUF draft")
    ap.add_argument("--first-layers", default="",
                    help="also drafts of the model's own first N layers, e.g. 1,2,4")
    ap.add_argument("--ks", default="2,4,adaptive")
    ap.add_argument("--temp", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--cache-fraction", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sp = SamplingParams(greedy=args.temp <= 0, temperature=args.temp)
    prompts = _prompts(args.prompts, args.prompt_len)
    print(f"reference model ({REFERENCE_MODEL.name}), {len(prompts)} prompts of "
          f"{args.prompt_len} held-out tokens, {args.gen} generated "
          f"({'greedy' if sp.greedy else f'temperature {args.temp}'}), promoe at cache fraction "
          f"{args.cache_fraction}, {platform.machine()} with {os.cpu_count()} CPUs, "
          f"{args.threads} threads\n")
    base = _run(prompts, args.gen, sp, args.cache_fraction, args.threads, None, None)
    print(f"no draft: {base['tpot_s'] * 1e3:.2f} ms a token\n")
    print("| draft | k | accepted | tokens a verification | prefetch precision (chance) / "
          "recall (cutoff) | ms a token | over no draft | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    drafts = [d for d in args.drafts.split(",") if d] + \
        ([args.draft_model] if args.draft_model else [])
    tmp = tempfile.TemporaryDirectory(prefix="spec_bench-")
    for n in (int(x) for x in args.first_layers.split(",") if x):
        stem = REFERENCE_MODEL.stem.replace("-q8_0", "")
        drafts.append(str(make_draft(REFERENCE_MODEL, Path(tmp.name) / f"{stem}-first{n}.gguf",
                                     n).path))
    rows = []
    for draft in drafts:
        for ks in args.ks.split(","):
            k = None if ks == "adaptive" else int(ks)
            r = _run(prompts, args.gen, sp, args.cache_fraction, args.threads, draft, k)
            s = r["stats"]
            same = r["tokens"] == base["tokens"] if sp.greedy else None
            row = {"draft": s["draft"], "k": ks, "acceptance": s["acceptance"],
                   "tokens_per_verify": (s["mean_accepted"] or 0.0) + 1,
                   "verify_passes": s["verify_passes"], "drafted": s["drafted"],
                   "accepted": s["accepted"], "tpot_s": r["tpot_s"],
                   "speedup": base["tpot_s"] / r["tpot_s"], "same_tokens": same,
                   "prefetch_precision": s.get("prefetch_precision"),
                   "prefetch_recall": s.get("prefetch_recall"),
                   "prefetch_precision_chance": s.get("prefetch_precision_chance"),
                   "spec_cutoff": s.get("spec_cutoff"),
                   "first_layers": _first_layers(draft)}
            rows.append(row)
            pr = "-" if row["prefetch_precision"] is None else \
                (f"{row['prefetch_precision']:.2f} ({row['prefetch_precision_chance']:.2f}) / "
                 f"{row['prefetch_recall']:.2f} ({row['spec_cutoff']})")
            print(f"| {row['draft']} | {ks} | {row['acceptance']:.3f} | "
                  f"{row['tokens_per_verify']:.2f} | {pr} | {r['tpot_s'] * 1e3:.2f} | "
                  f"{row['speedup']:.2f}x | {'-' if same is None else 'yes' if same else 'NO'} |",
                  flush=True)
    tmp.cleanup()
    if args.json:
        args.json.write_text(json.dumps({"model": REFERENCE_MODEL.name,
                                         "prompts": len(prompts), "gen": args.gen,
                                         "temp": args.temp, "no_draft_tpot_s": base["tpot_s"],
                                         "runs": rows}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
