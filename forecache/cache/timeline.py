"""Where a pass's time goes, layer by layer: the expert cache's timeline.

The C cache records spans of its own work when asked (``forecache_cache_set_timeline``): each
layer's routed ids read back (which waits for the device to reach the layer), its gate, compute
waiting for copies, expert compute on the CPU, expert groups computed from slots, and every chunk
the copy thread copies, and each layer computed without a stop (``quiet``: every expert
resident, a mark of no duration). ``summarize`` splits the passes into prompt passes (more than
one token routed) and decode passes and sums each kind per layer; ``format_summary`` prints it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from forecache.native.cache_api import SPAN_KINDS, Span

# spans a recording keeps (56 bytes each): a 512-token prompt of a 28-layer model and 64 tokens
# of decode take about 25,000
TIMELINE_CAPACITY = 1 << 18
# kinds on the critical path of the graph thread
PATH_KINDS = ("ids", "gate", "wait", "host", "group")
# spans on threads of their own (the copy engine, the disk tier's readers, prompt banks' fills),
# beside a pass
OFF_PATH_KINDS = ("copy", "read", "bank")


@dataclass(frozen=True)
class TimelineSpan:
    """One span of the cache's work (``SPAN_KINDS``); times in seconds from the start of the
    recording."""

    kind: str
    layer: int
    proj: int  # -1: every projection
    expert: int  # copies: the expert; -1 otherwise
    slot: int  # copies: the slot; -1 otherwise
    n: int  # ids, gate: tokens routed; host: rows; group: schedule entries
    pass_id: int
    nbytes: int  # copies: bytes copied; ids: bytes read back
    t0: float
    t1: float

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    @classmethod
    def from_c(cls, s: Span) -> TimelineSpan:
        kind = SPAN_KINDS[s.kind] if 0 <= s.kind < len(SPAN_KINDS) else f"kind{s.kind}"
        return cls(kind, s.layer, s.proj, s.expert, s.slot, s.n, int(s.pass_id), int(s.bytes),
                   s.t0, s.t1)


def pass_tokens(spans: list[TimelineSpan]) -> dict[int, int]:
    """Tokens each pass routed (the most any of its layers routed, read back, quiet or from a
    prompt bank)."""
    out: dict[int, int] = {}
    for s in spans:
        if s.kind in ("ids", "gate", "quiet", "bank"):
            out[s.pass_id] = max(out.get(s.pass_id, 0), s.n)
    return out


def _union(spans: list[TimelineSpan]) -> list[tuple[float, float]]:
    """The time ``spans`` cover, as disjoint intervals in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((s.t0, s.t1) for s in spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap_s(a: list[TimelineSpan], b: list[TimelineSpan]) -> float:
    """Seconds during which some span of ``a`` and some span of ``b`` both ran."""
    ua, ub = _union(a), _union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(spans: list[TimelineSpan], dropped: int = 0) -> dict:
    """Per phase ("prefill": passes routing more than one token, "decode": one): passes, their
    wall time (first span's start to last span's end, summed over the passes), seconds, count
    and summed ``n`` (rows, entries, tokens: ``TimelineSpan.n``) of each kind in all and per
    layer, the copies' bytes and rate over their busy time, and how long the CPU's host entries
    ran while the device side computed groups or waited (``host_overlap_s``: their two threads
    at once). Copies go to the phase of the pass that was running when they finished."""
    tokens = pass_tokens(spans)
    by_phase: dict[str, list[TimelineSpan]] = defaultdict(list)
    for s in spans:
        by_phase["prefill" if tokens.get(s.pass_id, 1) > 1 else "decode"].append(s)
    out: dict = {"dropped": dropped, "phases": {}}
    for phase in ("prefill", "decode"):
        group = by_phase.get(phase, [])
        if not group:
            continue
        bounds: dict[int, list[float]] = {}
        for s in group:
            if s.kind in OFF_PATH_KINDS:
                continue
            b = bounds.setdefault(s.pass_id, [s.t0, s.t1])
            b[0], b[1] = min(b[0], s.t0), max(b[1], s.t1)
        kinds = {k: {"s": 0.0, "n": 0, "items": 0} for k in SPAN_KINDS}
        layers: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(SPAN_KINDS, 0.0))
        copy_bytes = 0
        for s in group:
            k = kinds.setdefault(s.kind, {"s": 0.0, "n": 0, "items": 0})
            k["s"] += s.seconds
            k["n"] += 1
            k["items"] += max(s.n, 0)
            layers[s.layer][s.kind] = layers[s.layer].get(s.kind, 0.0) + s.seconds
            if s.kind == "copy":
                copy_bytes += s.nbytes
        copy_s = kinds["copy"]["s"]
        out["phases"][phase] = {
            "passes": len(bounds),
            "wall_s": sum(b[1] - b[0] for b in bounds.values()),
            "kinds": kinds,
            "layers": {il: dict(v) for il, v in sorted(layers.items())},
            "copy_bytes": copy_bytes,
            "copy_gbps": copy_bytes / copy_s / 1e9 if copy_s > 0 else 0.0,
            "host_overlap_s": overlap_s([s for s in group if s.kind == "host"],
                                        [s for s in group if s.kind in ("group", "wait")]),
        }
    return out


def format_summary(summary: dict, *, per_layer: bool = True) -> str:
    """The summary as tables: per phase, each kind's milliseconds a pass, then per layer."""
    lines = []
    if summary.get("dropped"):
        lines.append(f"({summary['dropped']} spans dropped: the recording kept the last ones)")
    for phase, p in summary["phases"].items():
        n = max(p["passes"], 1)
        ms = {k: v["s"] * 1e3 / n for k, v in p["kinds"].items()}
        lines.append(f"{phase}: {p['passes']} passes, {p['wall_s'] * 1e3 / n:.2f} ms a pass "
                     f"from the first layer's ids to the last span; a pass: "
                     + ", ".join(f"{k} {ms.get(k, 0.0):.2f} ms" for k in PATH_KINDS)
                     + f"; copies {p['copy_bytes'] / n / 1e6:.1f} MB in {ms['copy']:.2f} ms "
                     f"({p['copy_gbps']:.1f} GB/s while copying)")
        host = p["kinds"].get("host", {})
        if host.get("n"):
            lines.append(f"  host entries: {host['items'] / n:.0f} rows a pass in "
                         f"{host['n'] / n:.1f} spans, {p.get('host_overlap_s', 0.0) * 1e3 / n:.2f}"
                         f" ms of their {ms['host']:.2f} ms beside groups or waits; groups: "
                         f"{p['kinds']['group']['items'] / n:.0f} entries in "
                         f"{p['kinds']['group']['n'] / n:.1f} groups a pass")
        if per_layer:
            lines.append(f"  {'layer':>5} " + " ".join(f"{k + ' ms':>9}" for k in SPAN_KINDS))
            for il, v in p["layers"].items():
                lines.append(f"  {il:>5} " + " ".join(f"{v.get(k, 0.0) * 1e3 / n:>9.3f}"
                                                      for k in SPAN_KINDS))
    return "\n".join(lines)
