"""Quadrature for the designer: fixed Gauss-Legendre moments and an adaptive integral.

Both split the line at every point where an integrand may be non-smooth (borders, jumps of
f', edges of a histogram), so Gauss-Legendre sees only smooth pieces.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from actdesign.errors import ActdesignError


@lru_cache(maxsize=8)
def _gauss_legendre(order: int):
    return np.polynomial.legendre.leggauss(order)


def _pieces(cuts: np.ndarray, mesh: np.ndarray):
    inner = mesh[(mesh > cuts[0]) & (mesh < cuts[-1])]
    pts = np.union1d(cuts, inner)
    return pts[:-1], pts[1:]


def interval_moments(g, pdf, cuts, mesh, shift=0.0, order=16):
    """W, F, S over each interval [cuts[k], cuts[k+1]]: the integrals of w, (g-shift)·w and
    (g-shift)²·w. `mesh` holds extra split points (breakpoints, a resolution mesh)."""
    cuts = np.asarray(cuts, dtype=float)
    a, b = _pieces(cuts, np.asarray(mesh, dtype=float))
    nodes, weights = _gauss_legendre(order)
    half = 0.5 * (b - a)
    xs = (0.5 * (a + b))[:, None] + half[:, None] * nodes[None, :]
    w = pdf(xs)
    gv = g(xs) - shift
    bad = (w > 0) & ~np.isfinite(gv)
    if bad.any():
        raise ActdesignError(f"the derivative is not finite near x = {xs[bad][0]:.6g}")
    gw = np.where(w > 0, gv * w, 0.0)
    owner = np.searchsorted(cuts, a, side="right") - 1
    n = cuts.size - 1

    def total(values):
        return np.bincount(owner, weights=(values @ weights) * half, minlength=n)

    return total(w), total(gw), total(np.where(w > 0, gv * gw, 0.0))


def adaptive_integral(fn, breaks, rtol=1e-12, atol=0.0, max_rounds=60, max_pieces=50_000):
    """∫ fn over [breaks[0], breaks[-1]], splitting at `breaks`, by adaptive bisection.

    Each piece is estimated with 10- and 20-point Gauss-Legendre; pieces whose difference is
    above their share of the tolerance are halved, up to `max_pieces` at once. Returns (value,
    error estimate); a divergent integral shows as a large estimate.
    """
    a = np.asarray(breaks[:-1], dtype=float)
    b = np.asarray(breaks[1:], dtype=float)
    keep = b > a
    a, b = a[keep], b[keep]
    n10, w10 = _gauss_legendre(10)
    n20, w20 = _gauss_legendre(20)
    done_value, done_error = 0.0, 0.0
    for _ in range(max_rounds):
        half = 0.5 * (b - a)
        mid = 0.5 * (a + b)
        i10 = (fn(mid[:, None] + half[:, None] * n10) @ w10) * half
        i20 = (fn(mid[:, None] + half[:, None] * n20) @ w20) * half
        with np.errstate(invalid="ignore"):  # inf - inf: a divergent piece, kept as NaN
            err = np.abs(i20 - i10)
        value = done_value + i20.sum()
        tol = max(atol, rtol * abs(value))
        share = tol / max(a.size, 1)
        ok = (err <= share) | (half <= 4 * np.finfo(float).eps * np.maximum(1.0, np.abs(mid)))
        done_value += i20[ok].sum()
        done_error += err[ok].sum()
        if ok.all() or done_error + err[~ok].sum() <= tol or 2 * (~ok).sum() > max_pieces:
            return done_value + i20[~ok].sum(), done_error + err[~ok].sum()
        a, b, mid = a[~ok], b[~ok], mid[~ok]
        a, b = np.concatenate([a, mid]), np.concatenate([mid, b])
    return done_value + i20[~ok].sum(), done_error + err[~ok].sum()
