"""Fitting a few parameters to measurements without scipy: the rates a batch plan is priced
with (``jobs.plan``) and the simulator's calibration (``sim.calibrate``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.5,
                iters: int = 120, tol: float = 1e-3) -> np.ndarray:
    """Minimise ``f`` from ``x0`` (a small, dependency-free Nelder-Mead)."""
    n = len(x0)
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[int(np.argmin(vals))]


def minimise(f: Callable[[np.ndarray], float], x0: np.ndarray, *, iters: int = 300,
             tol: float = 1e-6, restarts: int = 12) -> np.ndarray:
    """Minimise ``f`` from ``x0`` by Nelder-Mead restarted from its best point with a fresh
    simplex, wide and narrow in turn, until a restart gains nothing: a simplex collapses on
    the kinks of a roofline (a rate that stops mattering where another one binds) and stalls
    short of the minimum."""
    best = nelder_mead(f, x0, iters=iters, tol=tol)
    val = f(best)
    for k in range(restarts):
        cand = nelder_mead(f, best, step=1.0 if k % 2 == 0 else 0.3, iters=iters, tol=tol)
        got = f(cand)
        if got < val:
            best, gain, val = cand, val - got, got
        else:
            gain = 0.0
        if k and gain < tol:  # both widths tried and neither moved it
            break
    return best
