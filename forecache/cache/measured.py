"""What was measured of a model's routing and of this machine, kept for the default placement.

One JSON file per model (by content fingerprint) in the cache directory:

- ``locality``: points (slot share, locality, decode lookups, source) of the model's decode
  routing. A promoe run adds its decode hit rate at its share (``source`` "run"); ``forecache
  trace`` adds an LRU replay of the trace's decode rows at every share on the grid ("trace").
  Points at the same share are averaged, weighted by lookups.
- ``devices``: per device, the copy rate and CPU compute scale the latest promoe run measured.

``load_evidence`` gives ``choice.choose`` the point nearest at or below the share asked for
(locality grows with the share, so a lower point errs towards ncmoe).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from forecache.cache.choice import Evidence, locality
from forecache.cache.cost import CostModel
from forecache.gguf.header import ModelFile
from forecache.gguf.identity import fingerprint
from forecache.paths import cache_dir, write_atomic

# decode expert lookups a run needs before its hit rate is worth keeping (a few dozen tokens)
MIN_LOOKUPS = 512
GRID = 0.05  # shares are kept on this grid
TOLERANCE = GRID / 2  # a point this far above the share asked for still counts


def record_path(model: ModelFile) -> Path:
    """The model's record file."""
    return cache_dir() / "measured" / f"{fingerprint(model)[:32]}.json"


def _read(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: the prior stands in
    return raw if isinstance(raw, dict) else {}


def _points(data: dict) -> list[tuple[float, float, int, str]]:
    out = []
    for p in data.get("locality") or []:
        try:
            out.append((float(p[0]), float(p[1]), int(p[2]), str(p[3])))
        except (IndexError, TypeError, ValueError):
            continue  # a damaged point is skipped, the others still count
    return out


def load_evidence(model: ModelFile, device: str, share: float) -> Evidence | None:
    """The measured decode locality of ``model`` at ``share`` and ``device``'s measured rates;
    None when nothing was measured at or below ``share``."""
    data = _read(record_path(model))
    below = [p for p in _points(data) if p[0] <= share + TOLERANCE]
    if not below:
        return None
    at, loc, lookups, source = max(below, key=lambda p: p[0])
    copy, scale = _rates(data, device)
    return Evidence(loc, source, lookups, copy, scale, at)


def _rates(data: dict, device: str) -> tuple[float | None, float]:
    dev = (data.get("devices") or {}).get(device)
    dev = dev if isinstance(dev, dict) else {}
    try:
        copy = float(dev["copy_gbps"]) if dev.get("copy_gbps") else None
        scale = float(dev.get("host_scale", 1.0))
    except (TypeError, ValueError):
        return None, 1.0
    return copy, scale


def measured_rates(model: ModelFile, device: str) -> tuple[float | None, float]:
    """The expert copy rate (GB/s; None: never measured) and the CPU's measured / modelled
    expert compute time that the last promoe run of ``model`` on ``device`` kept."""
    return _rates(_read(record_path(model)), device)


def add_localities(model: ModelFile, points: Sequence[tuple[float, float, int]], source: str,
                   device: str | None = None, cost: CostModel | None = None) -> bool:
    """Fold (share, locality, lookups) points measured by ``source`` into the model's record,
    with ``cost``'s measured rates for ``device``; False when the record cannot be written."""
    path = record_path(model)
    data = _read(path)
    merged = {round(p[0] / GRID): p for p in _points(data)}
    for share, loc, n in points:
        key = round(share / GRID)
        old = merged.get(key)
        src = source
        if old is not None:
            seen = old[2]
            loc = (old[1] * seen + loc * n) / (seen + n)
            n += seen
            src = old[3] if source in old[3].split("+") else f"{old[3]}+{source}"
        merged[key] = (round(key * GRID, 2), loc, n, src)
    data["model"] = model.name
    data["locality"] = [list(p) for _, p in sorted(merged.items())]
    if device is not None and cost is not None:
        dev = {"host_scale": cost.host_scale}
        if cost.copy_measured:
            dev["copy_gbps"] = cost.copy_gbps
        data.setdefault("devices", {})[device] = dev
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(data, indent=1))
    except OSError:
        return False
    return True


def record_run(model: ModelFile, device: str, share: float, hits: int, misses: int,
               cost: CostModel | None) -> bool:
    """Keep one promoe run's decode hit rate at slot share ``share`` and ``cost``'s measured
    rates; False when it decoded too little to count or the record cannot be written."""
    n = hits + misses
    if n < MIN_LOOKUPS:
        return False
    return add_localities(model, [(share, locality(hits / n, share), n)], "run", device, cost)
