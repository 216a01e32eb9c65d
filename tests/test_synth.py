"""Synthetic routing traces: the fit reaches a real trace's statistics, at any depth."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cli_helpers import run_cli

from forecache.trace import synth
from forecache.trace.format import TraceFile
from forecache.trace.stats import routing_stats

# `forecache routing-stats` of ../shared/traces/olmoe_1b_7b_nf4gemm_decode_4x512.npz (OLMoE-1B-7B:
# 64 experts, top-8, as Qwen2-57B-A14B routes): the figures a fit is asked to reach
OLMOE = {"load_entropy": 0.929, "request_entropy": 0.863, "reuse@1": 0.392, "reuse@4": 0.657,
         "reuse@16": 0.911, "nmi_adjusted": 0.253, "cond_accuracy": 0.394}
TOLERANCE = 0.04


def test_fit_reaches_real_statistics_and_holds_at_another_depth() -> None:
    params, reached = synth.fit(OLMOE, n_expert=64, top_k=8, n_layers=6, tokens=256,
                                n_requests=4, seed=3)
    off = {k: round(abs(reached[k] - v), 3) for k, v in OLMOE.items()}
    assert max(off.values()) <= TOLERANCE, off
    # the same parameters, another seed and more layers: per-layer figures stay where they were
    reqs = synth.synthesize(params, n_layers=12, n_expert=64, top_k=8, tokens=[256] * 4,
                            seed=11)
    again = synth.target_values(synth.report(reqs, 64))
    off = {k: round(abs(again[k] - reached[k]), 3) for k in OLMOE}
    assert max(off.values()) <= TOLERANCE, off


def test_synthesis_is_seeded_and_well_formed() -> None:
    p = synth.SynthParams(skew=1.0, focus=0.4, stick=0.3, follow=0.5)
    a = synth.synthesize(p, n_layers=5, n_expert=16, top_k=4, tokens=[40, 24], prefill=[30, 0],
                         seed=7)
    b = synth.synthesize(p, n_layers=5, n_expert=16, top_k=4, tokens=[40, 24], prefill=[30, 0],
                         seed=7)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.experts, y.experts) and np.array_equal(x.phase, y.phase)
    r = a[0]
    assert r.experts.shape == (40, 5, 4) and int((r.phase == 0).sum()) == 30
    # k distinct experts per token and layer, all in range
    srt = np.sort(r.experts, axis=2)
    assert (np.diff(srt, axis=2) > 0).all() and srt.min() >= 0 and srt.max() < 16
    # following the layer above and sticking to the last token both show in the report
    flat = synth.target_values(synth.report(synth.synthesize(
        synth.SynthParams(skew=1.0, focus=0.4, stick=0.0, follow=0.0), n_layers=5, n_expert=16,
        top_k=4, tokens=[200] * 2, seed=7), 16))
    linked = synth.target_values(synth.report(synth.synthesize(
        synth.SynthParams(skew=1.0, focus=0.4, stick=0.5, follow=0.9), n_layers=5, n_expert=16,
        top_k=4, tokens=[200] * 2, seed=7), 16))
    assert linked["reuse@1"] > flat["reuse@1"] + 0.1
    assert linked["nmi_adjusted"] > flat["nmi_adjusted"] + 0.2


def test_synth_trace_cli(tmp_path: Path) -> None:
    like = tmp_path / "like.npz"
    real = synth.synthesize(synth.SynthParams(skew=0.8, focus=0.5, stick=0.4, follow=0.6),
                            n_layers=4, n_expert=16, top_k=4, tokens=[96] * 4, seed=5)
    synth.write_trace(like, real, {"n_expert": 16})
    out = tmp_path / "tiny.npz"
    res = run_cli("synth-trace", "--like", str(like), "--shape", "tiny", "--out", str(out),
                  "--requests", "3", "--prefill", "20", "--decode", "10", check=True)
    assert "synthetic" in res.stdout
    with TraceFile(out) as tf:
        info = tf.info()
        assert (info.n_layers, info.n_expert, info.top_k) == (4, 16, 4)
        assert tf.meta["synthetic"] is True and tf.meta["preset"] == "tiny"
        assert tf.meta["fitted_to"] == "like.npz" and len(tf.units()) == 3
        got = synth.target_values(routing_stats(tf).summary())
    assert abs(got["reuse@1"] - tf.meta["targets"]["reuse@1"]) < 0.1
    # the simulator replays it at the shape it names
    sim = run_cli("simulate", "--trace", str(out), "--compare", "--cache-fraction", "0.5",
                  "--fit-fraction", "0.34", check=True)
    assert "ratios to ncmoe" in sim.stdout
    # a shape with a dense first layer: its MoE layers only, and it replays at that shape
    ds = tmp_path / "ds.npz"
    run_cli("synth-trace", "--like", str(like), "--shape", "tiny-deepseek2", "--out", str(ds),
            "--requests", "3", "--prefill", "20", "--decode", "10", check=True)
    with TraceFile(ds) as tf:
        assert tf.info().n_layers == 3
    run_cli("simulate", "--trace", str(ds), "--cache-fraction", "0.5", "--fit-fraction", "0.34",
            check=True)
    # a shape of another expert count or top-k is refused, and nothing is overwritten
    bad = run_cli("synth-trace", "--like", str(like), "--shape", "qwen2-57b-a14b", "--out",
                  str(tmp_path / "x.npz"))
    assert bad.returncode != 0 and "same expert count and top-k" in bad.stderr
    again = run_cli("synth-trace", "--like", str(like), "--shape", "tiny", "--out", str(out))
    assert again.returncode != 0 and "--force" in again.stderr
