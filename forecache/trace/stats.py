"""Routing statistics of a trace: does a model route like real MoE models do?

Real routers are balanced across a workload but skewed within one request: the load entropy over
the whole trace is close to 1 while a single request uses fewer experts, reuses them from token to
token, and consecutive layers' choices are correlated. Everything is computed per MoE layer on the
rows whose routing in that layer is known (rows with a -1 in that layer are dropped, so a window
of w tokens is the next w *known* tokens of the request), then averaged over layers.

Definitions (E experts, k routed per token, units as :meth:`TraceFile.units` gives them):

* load entropy: entropy of the expert shares over the whole trace / log(E) (1 = balanced).
* request entropy: the same within each unit, averaged over units weighted by their tokens. A unit
  of T tokens cannot exceed log(T * k) / log(E), so very short units read low regardless.
* reuse@w: probability that an expert routed at token t is routed again at one of t+1..t+w of the
  same unit, over the t whose t+w is inside the unit. The independent expectation draws every
  token from the layer's overall load: sum_e p_e (1 - (1 - q_e)^w), with q_e the fraction of
  tokens routed to e and p_e = q_e / k.
* cross-layer agreement, for each pair of consecutive MoE layers *with data* (with partial traces
  the pair may skip layers; ``to - from`` says so): normalised mutual information
  MI / sqrt(H_l H_l') between the top-1 experts (slot 0, the highest-scoring expert in every
  trace format here). Top-1 rather than all k x k slot pairs, because the pairs of one token mix
  unrelated experts and cap the NMI below 1 even when l' is a function of l. The adjusted NMI
  subtracts the MI expected by chance (mean over 8 shuffles of layer l' across tokens), which is
  large for small traces: (MI - MI_chance) / (sqrt(H_l H_l') - MI_chance).
* conditional top-k accuracy: a table P(experts at l' | expert set at l) counted on the even units
  predicts the top-k experts of l' for each token of the odd units (a single-unit trace is split
  into two halves); score |predicted ∩ routed| / k. The table is keyed by the exact expert set at
  l; a set never seen in training backs off to the sum over its experts of the pairwise counts
  (expert a at l, expert b at l'). ``popular_accuracy`` is the same score for the k experts most
  used at l' in training, i.e. what knowing nothing about layer l gives.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from forecache.trace.format import Request, TraceError, TraceFile

DEFAULT_WINDOWS = (1, 4, 16)
_SHUFFLES = 8
_CHUNK = 1 << 16  # rows per block when scoring the backoff table (bounds rows x E memory)


@dataclass
class LayerStats:
    """Statistics of one MoE layer."""

    layer: int
    tokens: int
    load_entropy: float
    request_entropy: float
    share: list[float]
    max_share: float
    top10_share: float
    reuse: dict[int, float]
    reuse_independent: dict[int, float]


@dataclass
class PairStats:
    """Agreement between the MoE layers ``src`` and ``dst`` (consecutive among those with data)."""

    src: int
    dst: int
    tokens: int
    nmi: float
    nmi_adjusted: float
    cond_accuracy: float
    popular_accuracy: float
    seen_fraction: float
    test_tokens: int


@dataclass
class RoutingStats:
    """Routing report of a trace: per layer, per layer pair, and their means."""

    trace: str
    model: str | None
    n_tokens: int
    n_requests: int
    n_layers: int
    n_expert: int
    top_k: int
    prefill_tokens: int | None
    decode_tokens: int | None
    windows: list[int]
    top10_experts: int
    layers: list[LayerStats] = field(default_factory=list)
    pairs: list[PairStats] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Means over the layers with data (and over layer pairs for the agreement figures)."""

        def mean(vals: Sequence[float]) -> float:
            a = np.asarray(vals, float)
            a = a[np.isfinite(a)]
            return float(a.mean()) if a.size else math.nan

        ls, ps = self.layers, self.pairs
        return {
            "load_entropy": mean([x.load_entropy for x in ls]),
            "request_entropy": mean([x.request_entropy for x in ls]),
            "max_share": mean([x.max_share for x in ls]),
            "max_share_vs_uniform": mean([x.max_share for x in ls]) * self.n_expert,
            "top10_share": mean([x.top10_share for x in ls]),
            "top10_share_vs_uniform":
                mean([x.top10_share for x in ls]) * self.n_expert / self.top10_experts,
            "reuse": {w: mean([x.reuse[w] for x in ls]) for w in self.windows},
            "reuse_independent": {w: mean([x.reuse_independent[w] for x in ls])
                                  for w in self.windows},
            "nmi": mean([p.nmi for p in ps]),
            "nmi_adjusted": mean([p.nmi_adjusted for p in ps]),
            "cond_accuracy": mean([p.cond_accuracy for p in ps]),
            "popular_accuracy": mean([p.popular_accuracy for p in ps]),
        }

    def to_json(self) -> dict[str, Any]:
        """Everything as JSON-ready values (NaN becomes null, floats rounded to 6 digits)."""
        d = asdict(self)
        d["layers_with_data"] = [x.layer for x in self.layers]
        d["summary"] = self.summary()
        return _clean(d)

    def header(self) -> str:
        """One line naming the trace and its shape."""
        phase = ""
        if self.prefill_tokens is not None:
            phase = f" ({self.prefill_tokens} prefill, {self.decode_tokens} decode)"
        model = f", model {self.model}" if self.model else ""
        reqs = f"{self.n_requests} request{'s' if self.n_requests != 1 else ''}"
        return (f"{self.trace}{model}: {self.n_tokens} tokens{phase}, {reqs}, "
                f"{len(self.layers)}/{self.n_layers} MoE layers with data, "
                f"{self.n_expert} experts, top-{self.top_k}")

    def table(self, per_layer: bool = False) -> str:
        """The summary (means over layers) as text; ``per_layer`` adds one row per layer/pair."""
        s = self.summary()
        e, n10 = self.n_expert, self.top10_experts
        rows = [
            ("load entropy / log(E)", s["load_entropy"], "1.000 = balanced"),
            ("request entropy / log(E)", s["request_entropy"],
             f"{math.log(self.top_k) / math.log(e):.3f} = one fixed set per request"
             if e > 1 else ""),
            ("max expert share", s["max_share"], f"{s['max_share_vs_uniform']:.2f}x uniform"),
            (f"share of top 10% ({n10}) experts", s["top10_share"],
             f"{s['top10_share_vs_uniform']:.2f}x uniform"),
        ]
        for w in self.windows:
            r, ind = s["reuse"][w], s["reuse_independent"][w]
            rows.append((f"reuse within {w} token{'s' if w > 1 else ''}", r,
                         f"{ind:.3f} if independent ({_ratio(r, ind)})"))
        rows += [
            ("cross-layer NMI (top-1)", s["nmi"], f"{_f(s['nmi_adjusted'])} adjusted for chance"),
            ("conditional top-k accuracy", s["cond_accuracy"],
             f"{_f(s['popular_accuracy'])} from popularity alone"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"{'metric':<{width}}  {'value':>7}  reference", "-" * (width + 30)]
        lines += [f"{name:<{width}}  {_f(v):>7}  {ref}" for name, v, ref in rows]
        for note in self.notes:
            lines.append(f"note: {note}")
        if per_layer:
            lines += ["", self.layer_table()]
        return "\n".join(lines)

    def layer_table(self) -> str:
        """One row per layer with data, then one per consecutive layer pair."""
        head = (f"{'layer':>5} {'tokens':>7} {'H_load':>7} {'H_req':>7} {'max_x':>6} "
                f"{'top10_x':>7}" + "".join(f" {'r@' + str(w):>6} {'ind@' + str(w):>7}"
                                            for w in self.windows))
        lines = [head, "-" * len(head)]
        for x in self.layers:
            lines.append(
                f"{x.layer:>5} {x.tokens:>7} {_f(x.load_entropy):>7} {_f(x.request_entropy):>7} "
                f"{x.max_share * self.n_expert:>6.2f} "
                f"{x.top10_share * self.n_expert / self.top10_experts:>7.2f}"
                + "".join(f" {_f(x.reuse[w]):>6} {_f(x.reuse_independent[w]):>7}"
                          for w in self.windows))
        if self.pairs:
            head = (f"{'pair':>7} {'tokens':>7} {'nmi':>6} {'adj':>6} {'cond':>6} {'popular':>7} "
                    f"{'seen':>6}")
            lines += ["", head, "-" * len(head)]
            for p in self.pairs:
                lines.append(f"{str(p.src) + '->' + str(p.dst):>7} {p.tokens:>7} {_f(p.nmi):>6} "
                             f"{_f(p.nmi_adjusted):>6} {_f(p.cond_accuracy):>6} "
                             f"{_f(p.popular_accuracy):>7} {_f(p.seen_fraction):>6}")
        return "\n".join(lines)


def _f(v: float) -> str:
    return f"{v:.3f}" if np.isfinite(v) else "-"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if np.isfinite(a) and np.isfinite(b) and b > 0 else "-"


def _clean(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return round(float(v), 6) if np.isfinite(v) else None
    if isinstance(v, np.integer):
        return int(v)
    return v


def dumps(stats: RoutingStats) -> str:
    """The report as a JSON document."""
    return json.dumps(stats.to_json(), indent=1)


# -- computation ------------------------------------------------------------------------------


def _entropy(counts: np.ndarray) -> np.ndarray:
    """Entropy (nats) of each row of a count matrix (or of a vector)."""
    c = np.asarray(counts, float)
    tot = c.sum(-1, keepdims=True)
    p = np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -(np.where(p > 0, p * np.log(p), 0.0)).sum(-1)


def _layer_stats(layer: int, ex: np.ndarray, uid: np.ndarray, n_expert: int,
                 windows: Sequence[int], n_top: int) -> LayerStats:
    """Stats of one layer from its known rows ``ex`` [n, k] and their unit ids ``uid`` [n]."""
    n, k = ex.shape
    log_e = math.log(n_expert) if n_expert > 1 else math.nan
    counts = np.bincount(ex.ravel(), minlength=n_expert)
    share = counts / counts.sum()
    load_h = float(_entropy(counts)) / log_e

    # per-unit loads: units are contiguous, so uid is non-decreasing and compacts with unique
    units, u = np.unique(uid, return_inverse=True)
    per_unit = np.bincount((u[:, None] * n_expert + ex).ravel(),
                           minlength=len(units) * n_expert).reshape(len(units), n_expert)
    unit_tokens = per_unit.sum(1) / k
    req_h = float((_entropy(per_unit) * unit_tokens).sum() / unit_tokens.sum()) / log_e

    # next occurrence of the same expert in the same layer: sort (expert, row) pairs, so the
    # following pair with the same expert is its next use; one pass serves every window
    row = np.repeat(np.arange(n), k)
    flat = ex.ravel()
    order = np.lexsort((row, flat))
    nxt = np.full(n * k, np.iinfo(np.int64).max // 2, np.int64)
    same = flat[order[1:]] == flat[order[:-1]]
    nxt[order[:-1][same]] = row[order[1:][same]]
    gap = nxt - row

    q = counts / n  # probability that a token routes to e, if tokens were independent
    reuse, indep = {}, {}
    for w in windows:
        valid_t = np.zeros(n, bool)
        if n > w:
            valid_t[:n - w] = uid[w:] == uid[:n - w]
        valid = valid_t[row]
        reuse[w] = float((gap[valid] <= w).mean()) if valid.any() else math.nan
        indep[w] = float((share * (1.0 - (1.0 - q) ** w)).sum())
    top = np.sort(share)[::-1]
    return LayerStats(layer, n, load_h, req_h, share.tolist(), float(top[0]),
                      float(top[:n_top].sum()), reuse, indep)


def _mutual_information(a: np.ndarray, b: np.ndarray, n_expert: int) -> float:
    joint = np.bincount(a.astype(np.int64) * n_expert + b, minlength=n_expert * n_expert)
    joint = joint.reshape(n_expert, n_expert) / len(a)
    pa, pb = joint.sum(1), joint.sum(0)
    nz = joint > 0
    return float((joint[nz] * np.log(joint[nz] / np.outer(pa, pb)[nz])).sum())


def _nmi(a: np.ndarray, b: np.ndarray, n_expert: int) -> tuple[float, float]:
    """(NMI, NMI adjusted for chance) of two label vectors."""
    ha = float(_entropy(np.bincount(a, minlength=n_expert)))
    hb = float(_entropy(np.bincount(b, minlength=n_expert)))
    norm = math.sqrt(ha * hb)
    if norm <= 0:
        return math.nan, math.nan  # a constant layer carries no information to agree on
    mi = _mutual_information(a, b, n_expert)
    rng = np.random.default_rng(0)  # fixed seed: the report is reproducible
    chance = float(np.mean([_mutual_information(a, rng.permutation(b), n_expert)
                            for _ in range(_SHUFFLES)]))
    adj = (mi - chance) / (norm - chance) if norm - chance > 1e-12 else math.nan
    return mi / norm, adj


def _overlap(pred: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """|pred ∩ actual| / k per row."""
    return (pred[:, :, None] == actual[:, None, :]).any(2).sum(1) / actual.shape[1]


def _cond_accuracy(src: np.ndarray, dst: np.ndarray, train: np.ndarray, n_expert: int,
                   ) -> tuple[float, float, float, int]:
    """(conditional accuracy, popularity accuracy, fraction of test sets seen, test tokens)."""
    test = ~train
    n_test = int(test.sum())
    if n_test == 0 or not train.any():
        return math.nan, math.nan, math.nan, n_test
    k = dst.shape[1]
    # exact-set table: key each token by its sorted expert set at the source layer
    _, key = np.unique(np.sort(src, 1), axis=0, return_inverse=True)
    key = key.ravel().astype(np.int64)
    tr_key, tr_dst = key[train], dst[train]
    # sparse counts of (key, expert at dst), ranked within each key by count (ties: lower id)
    cell, cnt = np.unique((np.repeat(tr_key, k) * n_expert + tr_dst.ravel()), return_counts=True)
    ck, ce = cell // n_expert, cell % n_expert
    order = np.lexsort((ce, -cnt, ck))
    ck, ce = ck[order], ce[order]
    first = np.searchsorted(ck, ck)  # start of each key's group
    rank = np.arange(len(ck)) - first
    n_keys = int(key.max()) + 1
    table = np.full((n_keys, k), -1, np.int64)
    keep = rank < k
    table[ck[keep], rank[keep]] = ce[keep]
    seen = np.zeros(n_keys, bool)
    seen[tr_key] = True

    te_key, te_src, te_dst = key[test], src[test], dst[test]
    hit = seen[te_key]
    pred = np.empty((n_test, k), np.int64)
    pred[hit] = table[te_key[hit]]
    # back-off for unseen sets: sum of pairwise (expert at src, expert at dst) counts
    pair = np.bincount((src[train][:, :, None].astype(np.int64) * n_expert
                        + tr_dst[:, None, :]).ravel(), minlength=n_expert * n_expert)
    pair = pair.reshape(n_expert, n_expert).astype(np.float64)
    load = np.bincount(tr_dst.ravel(), minlength=n_expert).astype(np.float64)
    popular = np.argsort(-load, kind="stable")[:k]
    # ties in the pairwise score (e.g. experts never seen in training) go to the popular experts
    pair = pair * (load.sum() + 1) + load[None, :] / k
    miss = np.flatnonzero(~hit)
    for s in range(0, len(miss), _CHUNK):
        idx = miss[s:s + _CHUNK]
        score = pair[te_src[idx]].sum(1)
        pred[idx] = np.argsort(-score, axis=1, kind="stable")[:, :k]
    acc = float(_overlap(pred, te_dst).mean())
    pop = float(_overlap(np.broadcast_to(popular, te_dst.shape), te_dst).mean())
    return acc, pop, float(hit.mean()), n_test


def routing_stats(trace: TraceFile, windows: Sequence[int] = DEFAULT_WINDOWS) -> RoutingStats:
    """Routing report of a trace (see the module docstring for the definitions)."""
    windows = sorted({int(w) for w in windows})
    if not windows or windows[0] < 1:
        raise ValueError("reuse windows are integers >= 1")
    experts = np.asarray(trace.array("experts"))
    n, n_layers, k = experts.shape
    if n == 0 or k == 0:
        raise TraceError(f"{trace.path}: the trace has no routed experts ({experts.shape})")
    if (experts < -1).any():
        raise TraceError(f"{trace.path}: expert ids below -1; the file is damaged")
    hi = int(experts.max())
    n_expert = int(trace.meta.get("n_expert") or hi + 1)
    if hi >= n_expert:
        raise TraceError(f"{trace.path}: expert id {hi} but the meta says {n_expert} experts")
    if n_expert < 2:
        raise TraceError(f"{trace.path}: {n_expert} expert(s); routing statistics need two")

    units = trace.units()
    uid = np.empty(n, np.int64)
    for i, rows in enumerate(units):
        uid[rows] = i
    known = (experts >= 0).all(2)  # [n, L]
    data_layers = [int(l_) for l_ in np.flatnonzero(known.any(0))]
    if not data_layers:
        raise TraceError(f"{trace.path}: no MoE layer has known routing (all -1)")

    prefill = decode = None
    if trace.has("phase"):
        phase = np.asarray(trace.array("phase"))
        prefill, decode = int((phase == 0).sum()), int((phase == 1).sum())
    meta = trace.meta
    model = meta.get("model_name") or meta.get("model") or meta.get("arch")
    n_top = max(1, round(n_expert / 10))
    st = RoutingStats(Path(trace.path).name, str(model) if model else None, n, len(units),
                      n_layers, n_expert, k, prefill, decode, list(windows), n_top)

    for layer in data_layers:
        rows = np.flatnonzero(known[:, layer])
        st.layers.append(_layer_stats(layer, experts[rows, layer].astype(np.int64), uid[rows],
                                      n_expert, windows, n_top))

    # even units train, odd units test; a single unit is split into halves
    if len(units) > 1:
        train_row = uid % 2 == 0
    else:
        train_row = np.arange(n) < n // 2
        st.notes.append("one request: conditional accuracy trains on its first half and tests "
                        "on the second")
    for src, dst in zip(data_layers[:-1], data_layers[1:], strict=True):
        both = known[:, src] & known[:, dst]
        if not both.any():
            continue
        a = experts[both, src].astype(np.int64)
        b = experts[both, dst].astype(np.int64)
        nmi, adj = _nmi(a[:, 0], b[:, 0], n_expert)
        acc, pop, seen, n_test = _cond_accuracy(a, b, train_row[both], n_expert)
        st.pairs.append(PairStats(src, dst, int(both.sum()), nmi, adj, acc, pop, seen, n_test))
    gaps = {p.dst - p.src for p in st.pairs}
    if gaps - {1}:
        st.notes.append(f"only some MoE layers have data: the layer pairs are {max(gaps)} layers "
                        "apart at most, so agreement is not between adjacent layers")
    if trace.has("seq") and (np.asarray(trace.array("seq")) < 0).any():
        how = "forward pass" if trace.has("step") else "contiguous run"
        st.notes.append(f"rows of unknown request are grouped by {how}: those 'requests' mix "
                        "several real ones")
    return st


def lru_hit_curves(requests: Sequence[np.ndarray], n_expert: int,
                   counted: Sequence[np.ndarray | None] | None = None) -> np.ndarray:
    """Hits [L, n_expert + 1] of a per-layer LRU cache of 0..n_expert slots over ``requests``
    (routed experts [T, L, k] each, -1 unknown), replayed one after the other as one stream.

    Each row is one gate: a cache of c slots holds the c experts used most recently before it, and
    a row routing more known experts than c is computed from host memory (no hits), as the
    policies do. ``counted`` (a bool mask [T] per request, or None for all rows) chooses which
    rows' lookups are counted; every row still updates the recency (decode rows after a prefill).
    """
    if not requests:
        return np.zeros((0, n_expert + 1), dtype=np.int64)
    n_layers = requests[0].shape[1]
    # hits by the smallest cache size they need, summed over sizes at the end
    diff = np.zeros((n_layers, n_expert + 2), dtype=np.int64)
    last = np.full((n_layers, n_expert), -1, dtype=np.int64)  # row of last use; -1 never
    rows_l = np.arange(n_layers)[:, None]
    t = 0
    for i, ex in enumerate(requests):
        ex = np.asarray(ex, dtype=np.int64)
        mask = None if counted is None or counted[i] is None else np.asarray(counted[i], bool)
        for r in range(ex.shape[0]):
            ids = ex[r]  # [L, k]
            known = ids >= 0
            safe = np.where(known, ids, 0)
            if mask is None or mask[r]:
                seen = last[rows_l, safe]  # [L, k]
                # recency rank: experts used strictly more recently than this one
                pos = (last[:, None, :] > seen[:, :, None]).sum(axis=2)
                need = known.sum(axis=1, keepdims=True)  # a row needs all its experts in slots
                start = np.maximum(pos + 1, need)
                hit = known & (seen >= 0)
                np.add.at(diff, (np.broadcast_to(rows_l, ids.shape)[hit],
                                 np.minimum(start[hit], n_expert + 1)), 1)
            t += 1
            last[np.broadcast_to(rows_l, ids.shape)[known], ids[known]] = t
    return np.cumsum(diff, axis=1)[:, :n_expert + 1]


def lru_hit_rate(requests: Sequence[Request], n_slots: int, phase: int | None = None) -> float:
    """Share of routed experts found in a per-layer LRU cache of ``n_slots`` experts, replaying
    ``requests`` one after the other as one stream decodes them (``lru_hit_curves``); with
    ``phase`` (0 prefill, 1 decode) only that phase's rows are counted (every row still passes
    through the cache). 0 when nothing is counted."""
    if n_slots < 1:
        raise ValueError(f"an LRU cache needs at least one slot, not {n_slots}")
    if not requests:
        return 0.0
    counted = [None if phase is None or r.phase is None else r.phase == phase for r in requests]
    n_expert = max(max(int(r.experts.max()) for r in requests) + 1, n_slots)
    curves = lru_hit_curves([r.experts for r in requests], n_expert, counted)
    total = 0
    for r, c in zip(requests, counted, strict=True):
        routed = r.experts if c is None else r.experts[c]
        total += int((routed >= 0).sum())
    return float(curves[:, n_slots].sum()) / total if total else 0.0
