"""Speculative decoding (SP-MoE) at the target in simulation: decode by draft, draft length and
acceptance, over non-speculative promoe and ncmoe (the faster of its --no-mmap and mmap runs);
and the cutoff-layer sweep.

    python benchmarks/spec_sim.py [--like TRACE.npz] [--shape qwen2-57b-a14b] [--budget 24GiB]
        [--profile rtx4090] [--requests 8] [--prefill 512] [--decode 128]
        [--drafts self-little:0.93,self-cached:0.96,model:qwen2-0.5b:0.7,model:4.7e9:0.8]
        [--ks 2,4,6] [--cutoffs 0,7,14,21,auto] [--accepts 0.5,0.6,0.7,0.8,0.9]
        [--seed 0] [--json OUT]

The routing is target_sim's. Each step drafts k tokens, verifies them with the current one in
one ubatch of k+1 rows, and accepts each draft with the draft's acceptance until the first
rejection (the trace's next rows stand for the drafts: an accepted draft is the token the trace
has there). Drafts, as KIND:ACCEPTANCE or model:BYTES:ACCEPTANCE:

- self-little: the model's little pass (top half of the top-k) drafts; the verification first
  prefetches what the little passes routed, every layer.
- self-cached: the little pass over the experts already in slots and the top-1.
- model: a dense draft of BYTES on the device (its weights and context take slots), whose hidden
  states name the verifier's experts through the target's gates as it reaches each layer
  (SP-MoE's cross-model predictor, taken as exact), layers up to the cutoff, copied while it
  drafts. The cutoff is SP-MoE's rule as the runtime applies it (``auto``) unless swept. BYTES
  may be a dense make-model preset's name: ``qwen2-0.5b`` (Qwen2-0.5B in q4_k_m, 0.39 GB, with
  its KV cache and compute buffers as the runtime's budget pays for them: 0.44 GB); Qwen2-7B's
  weights are 4.7e9.

The acceptances are inputs: the self drafts' defaults are measured on the reference model
(``spec_bench.py``); a model draft's comes from published measurements of real pairs
(``speculative.acceptance.PUBLISHED``, printed first with the per-token rates they give at
draft lengths 4, 8 and 16), so the first model draft is also swept over ``--accepts`` around
them, which says what acceptance the targets need. A model draft's rows are also run as stock
llama.cpp's best with the same draft under the same loop ("over ncmoe+draft": --n-cpu-moe with
the draft's weights on the device, no prefetch), the gain of the cache and prefetch apart from
drafting's own.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from forecache.cache.budget import dense_compute_bytes, draft_ubatch
from forecache.gguf.specs import get_spec, size_report
from forecache.sim.run import (
    NCMOE_LEGEND,
    StockBest,
    run_ncmoe,
    run_one,
    speedup,
    target_baselines,
    target_options,
)
from forecache.sim.simulate import SimConfig
from forecache.speculative.acceptance import PUBLISHED, per_token_rate

# the targets: decode over stock's best without a draft, and with the same draft
TARGETS = (("ncmoe", 2.0), ("ncmoe+draft", 1.3))

ROOT = Path(__file__).resolve().parents[1]
OLMOE = ROOT.parent / "shared" / "traces" / "olmoe_1b_7b_nf4gemm_decode_4x512.npz"


def preset_draft_bytes(name: str, n_ctx: int) -> float:
    """What a dense make-model preset's draft context takes on the device, as the runtime's
    budget pays for it (``budget.draft_device_bytes``): its q4_k_m weights, its KV cache of
    ``n_ctx`` cells and the compute buffers of its ubatch."""
    spec = get_spec(name)
    kv = spec.layers * spec.kv_heads * spec.head_dim * 2 * 2 * n_ctx
    compute = dense_compute_bytes(draft_ubatch(512), spec.ff, spec.d_model, spec.vocab)
    return float(size_report(spec, "q4_k_m").total_bytes + kv + compute)


def _draft_config(base: SimConfig, spec: str, top_k: int, n_ctx: int
                  ) -> tuple[str, SimConfig]:
    """A draft argument's label and SimConfig."""
    kind, *rest = spec.split(":")
    if kind == "model":
        try:
            nbytes, label = float(rest[0]), f"model {float(rest[0]) / 1e9:.1f} GB"
        except ValueError:  # a preset's name
            nbytes = preset_draft_bytes(rest[0], n_ctx)
            label = f"{rest[0]} ({nbytes / 1e9:.2f} GB)"
        accept = float(rest[1])
        return label, replace(base, spec_draft="model", draft_bytes=nbytes, spec_accept=accept)
    accept = float(rest[0])
    resident = kind == "self-cached"
    return kind, replace(base, spec_draft="little", spec_accept=accept,
                         little_k=top_k if resident else top_k // 2, little_resident=resident)


def _needed(rows: list[dict], ncmoe_s: float) -> None:
    """Print the lowest swept acceptance at which the best k reaches each target
    (``TARGETS``), interpolated between swept acceptances. Stock's best with the draft is its
    best k, or no drafting where that is faster (the same adaptive loop stops drafting where it
    does not pay)."""
    acc = sorted({r["acceptance"] for r in rows})
    for name, target in TARGETS:
        gain = []
        for a in acc:
            at = [r for r in rows if r["acceptance"] == a]
            stock = ncmoe_s if name == "ncmoe" else \
                min(ncmoe_s, *(r["ncmoe_draft_tpot_s"] for r in at))
            gain.append(stock / min(r["tpot_s"] for r in at))
        print(f"{target}x over {name}: " + ", ".join(f"{g:.2f}x at {a:.2f}"
                                                     for a, g in zip(acc, gain, strict=True)))
        at = next((i for i, g in enumerate(gain) if g >= target), None)
        if at is None:
            print(f"  not reached at acceptance <= {acc[-1]:.2f}")
        elif at == 0:
            print(f"  reached at acceptance {acc[0]:.2f} already")
        else:
            a0, a1, g0, g1 = acc[at - 1], acc[at], gain[at - 1], gain[at]
            print(f"  needs acceptance {a0 + (target - g0) * (a1 - a0) / (g1 - g0):.2f}")


def _cited() -> None:
    """The published acceptances and the per-token rates they give."""
    print("| pair | accepted / drafted | draft length | per-token rate at 4 / 8 / 16 | source |")
    print("|---|---|---|---|---|")
    for p in PUBLISHED:
        rates = " / ".join(f"{per_token_rate(p.share, n):.2f}" for n in (4, 8, 16))
        print(f"| {p.pair} | {p.share:.2f} | {p.n_draft or 'defaults'} | {rates} | "
              f"{p.source} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target_options(ap, OLMOE)
    ap.add_argument("--drafts", default="self-little:0.93,self-cached:0.96,model:qwen2-0.5b:0.7,"
                                        "model:4.7e9:0.8")
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--cutoffs", default="0,7,14,21,auto",
                    help="cutoff layers swept for the first model draft at k 4 (auto: "
                         "SP-MoE's rule, as the runtime applies it)")
    ap.add_argument("--accepts", default="0.5,0.6,0.7,0.8,0.9",
                    help="acceptances swept for the first model draft at each k, cutoff auto")
    args = ap.parse_args()
    t = target_baselines(args)
    shape, profile, replay, pred = t.shape, t.profile, t.replay, t.predictor
    base, nc, exact = t.base, t.ncmoe_best, t.promoe
    print(f"\n{t.header(args)}\n")
    _cited()
    print("| draft | acceptance | k | cutoff | tokens a step | TPOT ms | hit % | over promoe | "
          "over ncmoe | ncmoe+draft TPOT ms | over ncmoe+draft |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    done: dict[tuple, dict] = {}

    def one(label: str, cfg: SimConfig, cutoff: str) -> dict:
        key = (label, cfg.spec_accept, cfg.spec_k, cfg.spec_cutoff)
        if key in done:  # the sweep meets a row already printed: the same seeded run
            return done[key]
        r = run_one(replay, shape, profile, cfg, pred).to_json()
        if cutoff == "auto":
            cutoff = f"auto ({r.get('spec_cutoff_mean', 0.0):.1f})"
        r["over_ncmoe"] = nc.tpot_s / r["tpot_s"]
        stock = ""
        if cfg.spec_draft == "model":  # stock's best with the same draft, k and acceptance
            sd = StockBest(run_ncmoe(replay, shape, profile, replace(cfg, spec_cutoff=0)))
            r["ncmoe_draft_tpot_s"] = sd.tpot_s
            r["over_ncmoe+draft"] = sd.tpot_s / r["tpot_s"]
            stock = f"{sd.tpot_s * 1e3:.2f} | {speedup(sd.tpot_s, r['tpot_s'])}"
        rows.append({"draft": label, "acceptance": cfg.spec_accept, "k": cfg.spec_k,
                     "cutoff": cfg.spec_cutoff, **r})
        print(f"| {label} | {cfg.spec_accept:.2f} | {cfg.spec_k} | {cutoff} | "
              f"{r['tokens_per_step']:.2f} | {r['tpot_s'] * 1e3:.2f} | "
              f"{r['hit_rate'] * 100:.1f} | {speedup(exact.tpot_s, r['tpot_s'])} | "
              f"{speedup(nc.tpot_s, r['tpot_s'])} | {stock or '- | -'} |", flush=True)
        done[key] = rows[-1]
        return rows[-1]

    first_model = None
    for spec in args.drafts.split(","):
        label, cfg = _draft_config(base, spec, shape.top_k, args.prefill + args.decode)
        if cfg.spec_draft == "model" and first_model is None:
            first_model = (label, cfg)
        for k in (int(x) for x in args.ks.split(",")):
            if cfg.spec_draft == "model":
                one(label, replace(cfg, spec_k=k, spec_cutoff=-1), "auto")
            else:
                one(label, replace(cfg, spec_k=k), "-")
    if first_model is not None:
        label, cfg = first_model
        for c in args.cutoffs.split(","):
            one(label, replace(cfg, spec_k=4, spec_cutoff=-1 if c == "auto" else int(c)), c)
        swept = [one(label, replace(cfg, spec_accept=float(a), spec_k=int(k), spec_cutoff=-1),
                     "auto")
                 for a in args.accepts.split(",") if a for k in args.ks.split(",")]
        _needed(swept, nc.tpot_s)
    print(NCMOE_LEGEND + "; over ncmoe+draft: over the same, with the same draft, k and "
          "acceptance")
    t.write_json(args, rows, "promoe")


if __name__ == "__main__":
    main()
