"""ACCURACY_i(k) of every predictor on a trace, held out by request (ProMoE Fig. 8).

Requests are split into folds; each fold is scored by predictors fitted on the other folds, so
every request is scored exactly once and never by a predictor that saw it in training (online
learning within the test fold, such as the EAM collection taking in finished requests, is what
the runtime does too). A trace of a single request is split into two contiguous halves.

For target layer i and window k the prediction is made at layer max(i - k, 0) (ProMoE's fallback
for i < k); target layer 0 has no earlier layer and is not scored. The prefetcher issue multiplies
these accuracies by FETCHRATE_i(k) to get GOODPRED_i(k).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.predictor.base import source_layer
from forecache.predictor.metrics import topk_accuracy
from forecache.predictor.registry import GATE_INPUT_PREDICTORS, make_predictor, unavailable
from forecache.trace.format import Request, TraceFile

DEFAULT_WINDOWS = (1, 2, 4, 8)


@dataclass
class EvalResult:
    """Accuracy per predictor as [window, target layer] (NaN where not scored)."""

    trace: str
    windows: list[int]
    n_layers: int
    folds: int
    n_requests: int
    n_tokens: int
    accuracy: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def mean(self, name: str) -> np.ndarray:
        """Mean accuracy over the scored layers, per window (NaN if none)."""
        acc = self.accuracy[name]
        with np.errstate(invalid="ignore"):
            return np.array([np.nanmean(r) if np.isfinite(r).any() else np.nan for r in acc])

    def to_json(self) -> dict[str, Any]:
        def clean(a: np.ndarray) -> list:
            return [[None if not np.isfinite(v) else round(float(v), 6) for v in row] for row in a]

        return {
            "trace": self.trace, "windows": self.windows, "n_layers": self.n_layers,
            "folds": self.folds, "n_requests": self.n_requests, "n_tokens": self.n_tokens,
            "notes": self.notes, "skipped": self.skipped,
            "predictors": {
                name: {"mean": [None if not np.isfinite(v) else round(float(v), 6)
                                for v in self.mean(name)],
                       "accuracy": clean(acc),
                       "rows": self.rows[name].astype(int).tolist()}
                for name, acc in self.accuracy.items()
            },
        }

    def table(self) -> str:
        """Mean ACCURACY per predictor (rows) and window (columns)."""
        head = f"{'predictor':<10}" + "".join(f"{'k=' + str(k):>9}" for k in self.windows)
        lines = [head, "-" * len(head)]
        for name in self.accuracy:
            lines.append(f"{name:<10}" + "".join(
                f"{v:>9.3f}" if np.isfinite(v) else f"{'-':>9}" for v in self.mean(name)))
        for name, why in self.skipped.items():
            lines.append(f"{name:<10} n/a: {why}")
        return "\n".join(lines)

    def layer_table(self) -> str:
        """ACCURACY_i(k) for every scored layer."""
        scored = [i for i in range(self.n_layers)
                  if any(np.isfinite(a[:, i]).any() for a in self.accuracy.values())]
        lines = []
        for w, k in enumerate(self.windows):
            lines.append(f"k={k}: " + f"{'layer':<8}" + "".join(f"{i:>6}" for i in scored))
            for name, acc in self.accuracy.items():
                lines.append(f"     {name:<8}" + "".join(
                    f"{acc[w, i]:>6.2f}" if np.isfinite(acc[w, i]) else f"{'-':>6}"
                    for i in scored))
        return "\n".join(lines)


def _folds(units: list[np.ndarray], folds: int) -> tuple[list[np.ndarray], int, list[str]]:
    notes = []
    if len(units) == 1:
        rows = units[0]
        half = len(rows) // 2
        units = [rows[:half], rows[half:]]
        notes.append("one request in the trace: scored as two contiguous halves")
    return units, max(2, min(folds, len(units))), notes


def evaluate(trace: TraceFile, names: Sequence[str], windows: Sequence[int] = DEFAULT_WINDOWS,
             *, folds: int = 4, model: ModelFile | None = None,
             learned_epochs: int | None = None,
             progress: Callable[[str], None] | None = None) -> EvalResult:
    """Score every predictor of ``names`` on ``trace`` for every window (see module doc)."""
    info = trace.info()
    L = info.n_layers
    units, n_folds, notes = _folds(trace.units(), folds)
    res = EvalResult(str(trace.path.name), list(windows), L, n_folds, info.n_requests,
                     info.n_tokens, notes=notes)
    known = (np.asarray(trace.array("experts")) >= 0).all(axis=2).any(axis=0)  # [L]
    targets = [i for i in range(1, L) if known[i]]
    pairs_of = {k: [(source_layer(i, k), i) for i in targets] for k in windows}
    pairs = sorted({p for ps in pairs_of.values() for p in ps})
    runnable = []
    for name in names:
        why = unavailable(name, info, model)
        if why:
            res.skipped[name] = why
        else:
            runnable.append(name)
    for name in runnable:
        hits = np.zeros((len(windows), L))
        count = np.zeros((len(windows), L))
        needs_x = name in GATE_INPUT_PREDICTORS
        for f in range(n_folds):
            train = [trace.request(u, gate_input=needs_x) for j, u in enumerate(units)
                     if j % n_folds != f]
            test = [trace.request(u, gate_input=needs_x) for j, u in enumerate(units)
                    if j % n_folds == f]
            if not test:
                continue
            if progress:
                progress(f"{name}: fold {f + 1}/{n_folds} ({len(train)} train, {len(test)} "
                         "test requests)")
            p = make_predictor(name, info, pairs, model=model, learned_epochs=learned_epochs)
            p.fit(train)
            for req in test:
                _score(p, req, pairs, pairs_of, windows, hits, count)
        with np.errstate(invalid="ignore", divide="ignore"):
            res.accuracy[name] = np.where(count > 0, hits / np.maximum(count, 1), np.nan)
        res.rows[name] = count
    return res


def _score(p: Any, req: Request, pairs: list[tuple[int, int]],
           pairs_of: dict[int, list[tuple[int, int]]], windows: Sequence[int],
           hits: np.ndarray, count: np.ndarray) -> None:
    scores = p.score_request(req, pairs)
    for w, k in enumerate(windows):
        for lf, lt in pairs_of[k]:
            s, n = topk_accuracy(scores[(lf, lt)], np.asarray(req.experts[:, lt]))
            hits[w, lt] += s
            count[w, lt] += n


def plot(result: EvalResult, out: str, *, layer: int | None = None) -> None:
    """ProMoE Fig. 8: (a) accuracy per layer for each window, (b) accuracy against the window
    for one target layer (default: the last scored one) and the mean."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError(f"{setting('plot')} needs matplotlib: pip install 'forecache[plot]'") \
            from e
    names = list(result.accuracy)
    if not names:
        raise ValueError("nothing to plot: no predictor could run on this trace")
    scored = [i for i in range(result.n_layers)
              if any(np.isfinite(result.accuracy[n][:, i]).any() for n in names)]
    if layer is None:
        layer = scored[-1]
    nw = len(result.windows)
    fig, axes = plt.subplots(2, max(nw, 2), figsize=(3.4 * max(nw, 2), 6.4), squeeze=False)
    for w, k in enumerate(result.windows):
        ax = axes[0][w]
        for n in names:
            ax.plot(scored, result.accuracy[n][w, scored], marker=".", label=n)
        ax.set_title(f"(a) window k={k}")
        ax.set_xlabel("target layer i")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1.02)
        if w == 0:
            ax.set_ylabel("ACCURACY_i(k)")
    axes[0][0].legend(fontsize="small")
    for n in names:
        axes[1][0].plot(result.windows, result.accuracy[n][:, layer], marker="o", label=n)
        axes[1][1].plot(result.windows, result.mean(n), marker="o", label=n)
    axes[1][0].set_title(f"(b) layer {layer}")
    axes[1][1].set_title("(b) mean over layers")
    for ax in axes[1][:2]:
        ax.set_xlabel("window k")
        ax.set_xscale("log", base=2)
        ax.set_xticks(result.windows, [str(k) for k in result.windows])
        ax.set_ylim(0, 1.02)
    for ax in axes[1][2:]:
        ax.axis("off")
    fig.suptitle(f"Expert prediction accuracy: {result.trace}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def dumps(result: EvalResult) -> str:
    return json.dumps(result.to_json(), indent=1)
