"""Synthetic routing traces, fitted to what ``routing-stats`` measures on real ones.

No public trace has the shape forecache's users run (Qwen2-57B-A14B: 28 layers, 64 experts, top-8),
so the simulator replays routing made here at that shape. A small generative model covers the
properties that decide what a cache and a predictor can do, one parameter each:

* ``skew``: each layer's experts are popular by a Zipf law of this exponent (in a random order per
  layer): the load entropy over a whole workload.
* ``focus``: a request prefers its own experts (a Dirichlet draw per request and layer) with this
  weight against the layer's popularity: the request entropy.
* ``stick``: an expert routed at the previous token is routed again with this chance: reuse@w.
* ``follow``: the top-1 expert is the previous layer's top-1 mapped through a fixed successor table
  with this chance: cross-layer agreement (NMI adjusted for chance, conditional accuracy).

``fit`` searches the four parameters so that a small synthetic trace's report matches a real
trace's (same expert count and top-k), and ``synthesize`` then writes requests at any depth.
At another expert count and top-k (a 512-expert, top-10 shape fitted to a 64-expert, top-8
trace) the figures that chance alone raises with k / E are matched scale-free
(``scale_free_values``): reuse@w and the conditional accuracy as their excess over independent
routing and over popularity, as a share of the room above those. Everything is seeded: the same
parameters and seed give the same trace.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from forecache.trace.format import Request, TraceFile, TraceWriter
from forecache.trace.stats import routing_stats

# (summary key, reuse window or None, scale): the report figures a fit matches, each divided by a
# scale that makes one unit of error in any of them cost the same
FIT_TARGETS: tuple[tuple[str, int | None, float], ...] = (
    ("load_entropy", None, 0.02), ("request_entropy", None, 0.02), ("reuse", 1, 0.02),
    ("reuse", 4, 0.02), ("reuse", 16, 0.02), ("nmi_adjusted", None, 0.03),
    ("cond_accuracy", None, 0.03))
_DIRICHLET = 0.5  # concentration of a request's own preferences: a few experts each
_LIMITS = {"skew": (0.0, 3.0), "focus": (0.0, 1.0), "stick": (0.0, 0.95), "follow": (0.0, 0.95)}


@dataclass(frozen=True)
class SynthParams:
    """The generative model's four knobs (see the module docstring)."""

    skew: float = 0.5
    focus: float = 0.5
    stick: float = 0.3
    follow: float = 0.3


# ``fit`` to the OLMoE-1B-7B decode trace (64 experts, top-8, as Qwen2-57B-A14B), rounded: the
# routing the target is simulated with (BENCHMARKS.md)
OLMOE_FIT = SynthParams(skew=1.5, focus=0.44, stick=0.11, follow=0.36)


def synthesize(params: SynthParams, *, n_layers: int, n_expert: int, top_k: int,
               tokens: Sequence[int], prefill: Sequence[int] | None = None,
               seed: int = 0) -> list[Request]:
    """Requests of ``tokens[i]`` rows each (the first ``prefill[i]`` of them prefill), routed by
    the model with ``params``; experts [T, n_layers, top_k], top-1 in slot 0."""
    if not 0 < top_k <= n_expert:
        raise ValueError(f"top-k {top_k} must be in 1..{n_expert}")
    rng = np.random.default_rng(seed)
    rank = np.arange(1, n_expert + 1, dtype=np.float64) ** -params.skew
    popular = np.stack([rng.permutation(rank / rank.sum()) for _ in range(n_layers)])
    successor = np.stack([rng.permutation(n_expert) for _ in range(n_layers)])
    out = []
    for i, n_tok in enumerate(tokens):
        own = rng.dirichlet(np.full(n_expert, _DIRICHLET), size=n_layers)
        weights = (1 - params.focus) * popular + params.focus * own
        ex = np.empty((n_tok, n_layers, top_k), np.int16)
        for t in range(n_tok):
            for il in range(n_layers):
                ex[t, il] = _route(rng, params, weights[il], successor[il],
                                   ex[t, il - 1, 0] if il else -1,
                                   ex[t - 1, il] if t else None, top_k)
        n_pre = prefill[i] if prefill is not None else 0
        phase = np.r_[np.zeros(n_pre, np.int8), np.ones(n_tok - n_pre, np.int8)]
        out.append(Request(experts=ex, token_ids=rng.integers(0, 32000, n_tok).astype(np.int32),
                           phase=phase))
    return out


def _route(rng: np.random.Generator, p: SynthParams, weights: np.ndarray, successor: np.ndarray,
           above: int, previous: np.ndarray | None, k: int) -> list[int]:
    """One token's experts at one layer, top-1 first."""
    chosen: list[int] = []
    if above >= 0 and rng.random() < p.follow:
        chosen.append(int(successor[above]))
    elif previous is not None and rng.random() < p.stick:
        chosen.append(int(previous[0]))
    if previous is not None:
        for e in previous.tolist():
            if len(chosen) < k and e not in chosen and rng.random() < p.stick:
                chosen.append(int(e))
    if len(chosen) < k:
        w = weights.copy()
        w[chosen] = 0.0
        chosen += rng.choice(len(w), k - len(chosen), replace=False, p=w / w.sum()).tolist()
    return chosen


def report(requests: Sequence[Request], n_expert: int) -> dict:
    """The ``routing-stats`` summary of ``requests``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synth.npz"
        write_trace(path, requests, {"n_expert": n_expert})
        with TraceFile(path) as tf:
            return routing_stats(tf).summary()


def write_trace(path: Path, requests: Sequence[Request], meta: dict) -> None:
    """Write ``requests`` as a trace file with ``meta``."""
    n_layers, top_k = requests[0].experts.shape[1:]
    with TraceWriter(path, n_layers=n_layers, top_k=top_k, meta=meta) as w:
        for r in requests:
            assert r.token_ids is not None and r.phase is not None
            w.add_request(r.experts, token_ids=r.token_ids, phase=r.phase)


def target_values(summary: dict) -> dict[str, float]:
    """The figures of a ``routing-stats`` summary that a fit matches, by name (``reuse@4``)."""
    out = {}
    for key, w, _ in FIT_TARGETS:
        out[key if w is None else f"{key}@{w}"] = float(
            summary[key] if w is None else summary[key][w])
    return out


def scale_free_values(summary: dict) -> dict[str, float]:
    """``target_values`` with reuse@w and the conditional accuracy taken as the share of the room
    above chance that they fill: (x - chance) / (1 - chance), chance being independent routing's
    reuse and popularity's accuracy at the trace's own expert count and top-k. The entropies are
    normalised by log(E) and the NMI is chance-adjusted already."""
    out = target_values(summary)
    for key, w, _ in FIT_TARGETS:
        if key == "reuse":
            ind = float(summary["reuse_independent"][w])
            out[f"reuse@{w}"] = (out[f"reuse@{w}"] - ind) / (1.0 - ind)
    pop = float(summary["popular_accuracy"])
    out["cond_accuracy"] = (out["cond_accuracy"] - pop) / (1.0 - pop)
    return out


def _loss(got: dict[str, float], want: dict[str, float]) -> float:
    scale = {key if w is None else f"{key}@{w}": s for key, w, s in FIT_TARGETS}
    return sum(((got[k] - v) / scale[k]) ** 2 for k, v in want.items())


def fit(targets: dict[str, float], *, n_expert: int, top_k: int, n_layers: int = 8,
        tokens: int = 256, n_requests: int = 4, seed: int = 0, rounds: int = 6,
        progress: Callable[[str], None] = lambda s: None,
        values: Callable[[dict], dict[str, float]] = target_values,
        ) -> tuple[SynthParams, dict[str, float]]:
    """Parameters whose synthetic trace (``n_requests`` x ``tokens`` rows, ``n_layers`` layers)
    reports figures closest to ``targets`` (``values`` of a real trace's summary:
    ``target_values``, or ``scale_free_values`` at another shape), by coordinate search with
    halving steps on a fixed seed; returns them and the figures they reach."""

    def measure(p: SynthParams) -> dict[str, float]:
        reqs = synthesize(p, n_layers=n_layers, n_expert=n_expert, top_k=top_k,
                          tokens=[tokens] * n_requests, seed=seed)
        return values(report(reqs, n_expert))

    best = SynthParams()
    got = measure(best)
    loss = _loss(got, targets)
    step = dict.fromkeys(_LIMITS, 0.25)
    step["skew"] = 0.5
    for r in range(rounds):
        for name in _LIMITS:
            for sign in (1, -1):
                lo, hi = _LIMITS[name]
                value = min(hi, max(lo, getattr(best, name) + sign * step[name]))
                if value == getattr(best, name):
                    continue
                cand = replace(best, **{name: value})
                g = measure(cand)
                c_loss = _loss(g, targets)
                if c_loss < loss:
                    best, got, loss = cand, g, c_loss
                    break
            else:
                step[name] /= 2
        progress(f"round {r + 1}/{rounds}: loss {loss:.2f} at {asdict(best)}")
    return best, got


def synthesize_like(like: Path, shape: str, *, n_requests: int, prefill: int, decode: int,
                    seed: int = 0, progress: Callable[[str], None] = lambda s: None,
                    scale_free: bool = False) -> tuple[list[Request], dict]:
    """Requests of ``prefill`` + ``decode`` tokens at the models.yaml model ``shape``, routed by
    parameters fitted to the trace ``like`` (same expert count and top-k; with ``scale_free``,
    any: its ``scale_free_values`` are matched at the shape's own); returns them and the trace
    meta that says what they are (synthetic, fitted to what, how close)."""
    from forecache.gguf.specs import get_spec

    spec = get_spec(shape)
    with TraceFile(like) as tr:
        real = routing_stats(tr)
        units = [len(u) for u in tr.units()]
    if (real.n_expert, real.top_k) != (spec.experts, spec.top_k) and not scale_free:
        raise ValueError(
            f"{like.name} routes top-{real.top_k} of {real.n_expert} experts but {shape} routes "
            f"top-{spec.top_k} of {spec.experts}: fit to a trace with the same expert count and "
            "top-k")
    values = scale_free_values if scale_free else target_values
    targets = values(real.summary())
    # fit on as many requests as long as the real ones: request entropy depends on the length,
    # and the agreement figures on the number of tokens
    tokens = int(min(512, max(64, np.median(units))))
    params, reached = fit(targets, n_expert=spec.experts, top_k=spec.top_k, tokens=tokens,
                          n_requests=min(len(units), 8), seed=seed, progress=progress,
                          values=values)
    reqs = synthesize(params, n_layers=spec.moe_layers, n_expert=spec.experts, top_k=spec.top_k,
                      tokens=[prefill + decode] * n_requests, prefill=[prefill] * n_requests,
                      seed=seed + 1)
    meta = {"n_expert": spec.experts, "preset": spec.name, "synthetic": True,
            "fitted_to": like.name, "params": asdict(params), "targets": targets,
            "fit_reached": reached, "seed": seed,
            "fit": "scale-free" if scale_free else "same shape"}
    return reqs, meta
