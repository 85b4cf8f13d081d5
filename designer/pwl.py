"""Piecewise-linear fits of an activation itself (the Approx-BP idea behind ReGELU2/ReSiLU2).

    h~(x) = L(x) + Σ_{i=1}^{K} a_i · max(x - c_i, 0),   K = 2^b - 1,

where L(x) = α + βx is the activation's left linear asymptote, and two linear constraints make
h~ follow the right asymptote R(x) = γ + δx as well:  Σ a_i = δ - β,  Σ a_i c_i = α - γ.
h~' is a step function with 2^b levels (β, then β plus running sums of a), so the backward pass
needs b bits and runs on the stepwise kernels: borders = c, levels = β + cumsum(a).

For fixed knots c the best a solves a small equality-constrained least-squares problem exactly
(its Gram matrix comes from tail moments of the weight, tabulated by Gauss-Legendre), so the
search runs over knots only:
1. b = 1: the constraints fix the single kink.
2. b = 2: every triple of knots on a grid, then a continuous local refinement.
3. b >= 3: exact coordinate descent over the grid (each knot to its best grid position between
   its neighbours, until no knot moves) from deterministic starts, one of which is the
   (b-1)-bit optimum with extra zero-coefficient knots, so more bits never fit worse; then the
   continuous refinement.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from actdesign import closed_forms
from actdesign.activation import Activation, resolve
from actdesign.errors import ActdesignError

from .quadrature import _gauss_legendre, adaptive_integral
from .weights import Flat

MAX_PWL_BITS = 4
DEFAULT_TAIL_TOL = 1e-10
MAX_RANGE = 64.0
TABLE_CELLS = 4096  # cells of the tail-moment table
SEARCH_POINTS = 160  # grid positions for knots in the combinatorial search
ASYMPTOTE_SECONDS = 5.0  # per side, for an expression; legitimate limits take a second or two


@dataclass(frozen=True, eq=False)
class PwlFit:
    activation: Activation
    weight: object
    bits: int
    knots: np.ndarray  # c, strictly ascending
    coefficients: np.ndarray  # a
    left: tuple[float, float]  # (α, β): L(x) = α + βx
    right: tuple[float, float]  # (γ, δ)
    objective: float  # ∫ (h - h~)² w by adaptive quadrature
    objective_estimate: float  # its quadrature error bound
    max_abs: float  # max |h - h~| over the fit's domain
    domain: tuple[float, float]  # where the objective and the knots live

    @property
    def borders(self) -> np.ndarray:
        return self.knots

    @property
    def levels(self) -> np.ndarray:
        """β, then β plus the running sums of a (formed term by term, as the spec checks)."""
        out = [self.left[1]]
        for coefficient in self.coefficients:
            out.append(out[-1] + float(coefficient))
        return np.array(out)

    def __call__(self, x):
        x = np.asarray(x, dtype=float)
        alpha, beta = self.left
        hinge = np.maximum(x[..., None] - self.knots, 0.0) @ self.coefficients
        return alpha + beta * x + hinge


def asymptotes(act: Activation) -> tuple[tuple[float, float], tuple[float, float]]:
    """((α, β), (γ, δ)): the left and right linear asymptotes, as exact limits: a built-in's
    from its closed form, an expression's found by sympy within ASYMPTOTE_SECONDS a side."""
    if act.name is not None:
        found = closed_forms.ASYMPTOTES[act.name]
        if found is None:
            raise ActdesignError(f"{act.label} has no linear asymptote at +inf; a pwl fit "
                                 "follows both asymptotes")
        return found
    return _limits(act)


def _limits(act: Activation):
    """An expression's asymptotes: sympy's limits of f/x and f - βx at either side."""
    import sympy as sp

    from actdesign.expr import X, sigmoid, softplus, time_limit

    expr = act.f_expr.replace(sigmoid, lambda u: 1 / (1 + sp.exp(-u)))
    expr = expr.replace(softplus, lambda u: sp.log(1 + sp.exp(u)))
    sides = []
    slow = (f"{act.label}: sympy needs more than {ASYMPTOTE_SECONDS:g} s to find its "
            "asymptotes, which a pwl fit follows; write it more simply")
    for side, name in ((-sp.oo, "-inf"), (sp.oo, "+inf")):
        far = expr.replace(lambda e: isinstance(e, sp.Piecewise),
                           lambda e, side=side: _branch_at(e, side, X))
        try:
            with time_limit(ASYMPTOTE_SECONDS, slow):  # sp.limit may never return
                slope = sp.limit(far / X, X, side)
                offset = sp.limit(far - slope * X, X, side) if slope.is_finite else sp.oo
        except (NotImplementedError, ValueError, TypeError):
            slope = offset = sp.nan
        if not (slope.is_finite and offset.is_finite and slope.is_real and offset.is_real):
            raise ActdesignError(f"{act.label} has no linear asymptote at {name}; a pwl fit "
                                 "follows both asymptotes")
        sides.append((float(offset), float(slope)))
    return sides[0], sides[1]


def _branch_at(pw, side, x):
    import sympy as sp

    for value, cond in pw.args:
        holds = cond.subs(x, side)
        if holds is sp.true:
            return value
        if holds is not sp.false:
            break
    raise ActdesignError(f"cannot tell which branch of {pw} holds at {side}")


def fit_domain(act: Activation, left, right, tail_tol: float) -> tuple[float, float]:
    """[-B, B]: the smallest B on a doubling scale whose tails ∫ (h - asymptote)² beyond ±B
    (up to 8B) are below tail_tol, at most MAX_RANGE."""
    alpha, beta = left
    gamma, delta = right

    def tail(b):
        lo, _ = adaptive_integral(lambda x: (act.f(x) - alpha - beta * x) ** 2,
                                  np.linspace(-8 * b, -b, 9), rtol=1e-6, atol=1e-30)
        hi, _ = adaptive_integral(lambda x: (act.f(x) - gamma - delta * x) ** 2,
                                  np.linspace(b, 8 * b, 9), rtol=1e-6, atol=1e-30)
        return lo + hi

    b = 1.0
    while b < MAX_RANGE and tail(b) > tail_tol:
        b *= 2**0.25
    return (-min(b, MAX_RANGE), min(b, MAX_RANGE))


class Problem:
    """∫ (h - h~)² w over a domain, for any knots: tail moments tabulated once."""

    def __init__(self, act: Activation, weight, domain, left, right):
        self.act, self.weight = act, weight
        self.lo, self.hi = domain
        self.left, self.right = left, right
        breaks = np.concatenate([act.breakpoints(self.lo, self.hi), weight.breakpoints])
        grid = np.union1d(np.linspace(self.lo, self.hi, TABLE_CELLS + 1),
                          breaks[(breaks > self.lo) & (breaks < self.hi)])
        self.grid = grid
        cells = self._integrals(grid[:-1], grid[1:])
        self.table = np.vstack([np.cumsum(cells[::-1], axis=0)[::-1], np.zeros((1, 5))])
        alpha, beta = left
        self.base, _ = adaptive_integral(
            lambda x: (act.f(x) - alpha - beta * x) ** 2 * weight.pdf(x), grid[::64].tolist()
            + [self.hi], rtol=1e-13, atol=1e-300)
        self.constraint = np.array([right[1] - beta, alpha - right[0]])

    def _integrals(self, a, b):
        """∫ over [a, b] of w·(1, x, x², r, x·r), r = h - L: GL16, per interval."""
        nodes, weights = _gauss_legendre(16)
        half = 0.5 * (b - a)
        xs = (0.5 * (a + b))[:, None] + half[:, None] * nodes
        w = self.weight.pdf(xs)
        r = (self.act.f(xs) - self.left[0] - self.left[1] * xs) * w
        parts = np.stack([w, xs * w, xs * xs * w, r, xs * r])  # (5, n, 16)
        return ((parts @ weights) * half).T  # (n, 5)

    def tails(self, t: np.ndarray) -> np.ndarray:
        """∫_t^hi of w·(1, x, x², r, x·r) for any t in [lo, hi], shape t.shape + (5,)."""
        t = np.asarray(t, dtype=float)
        flat = t.reshape(-1)
        k = np.clip(np.searchsorted(self.grid, flat, side="right"), 1, self.grid.size - 1)
        out = self.table[k] + self._integrals(flat, self.grid[k])
        return out.reshape(t.shape + (5,))

    def solve(self, knots: np.ndarray):
        """For a batch of knot sets (S, K): the optimal coefficients (S, K) and objectives (S,)."""
        c = np.atleast_2d(knots)
        s, k = c.shape
        m0, m1, m2, p0, p1 = np.moveaxis(self.tails(c), -1, 0)
        ci, cj = c[:, :, None], c[:, None, :]
        # G_ij = ∫ (x - c_i)(x - c_j) w over x > max(c_i, c_j): moments taken at the later knot.
        later = np.where(cj >= ci, np.arange(k)[None, None, :], np.arange(k)[None, :, None])
        pick = np.take_along_axis
        idx = np.broadcast_to(later, (s, k, k)).reshape(s, k * k)
        m0j, m1j, m2j = (pick(v, idx, axis=1).reshape(s, k, k) for v in (m0, m1, m2))
        gram = m2j - (ci + cj) * m1j + ci * cj * m0j
        rhs = p1 - c * p0
        kkt = np.zeros((s, k + 2, k + 2))
        kkt[:, :k, :k] = gram
        kkt[:, :k, k] = kkt[:, k, :k] = 1.0
        kkt[:, :k, k + 1] = kkt[:, k + 1, :k] = c
        vec = np.concatenate([rhs, np.broadcast_to(self.constraint, (s, 2))], axis=1)
        with np.errstate(all="ignore"):
            try:
                sol = np.linalg.solve(kkt, vec[..., None])[..., 0]
            except np.linalg.LinAlgError:
                sol = np.stack([np.linalg.lstsq(m, v, rcond=None)[0]
                                for m, v in zip(kkt, vec, strict=True)])
        a = sol[:, :k]
        value = self.base - 2 * np.einsum("sk,sk->s", a, rhs) + np.einsum(
            "si,sij,sj->s", a, gram, a)
        bad = ~np.isfinite(value) | np.any(np.diff(c, axis=1) <= 0, axis=1)
        return a, np.where(bad, np.inf, value)

    def objective(self, knots) -> float:
        return float(self.solve(np.asarray(knots, dtype=float)[None, :])[1][0])


def fit_pwl(activation: Activation | str, bits: int, weight=None,
            tail_tol: float = DEFAULT_TAIL_TOL) -> PwlFit:
    """The best h~ with 2^b - 1 kinks. `weight` defaults to flat (unweighted) on [-B, B], B
    set by `tail_tol`; a Normal, Uniform or Histogram weight is used on its own range."""
    act = resolve(activation) if isinstance(activation, str) else activation
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_PWL_BITS:
        raise ActdesignError(f"pwl fits take bits in 1..{MAX_PWL_BITS}, got {bits!r}")
    if not (isinstance(tail_tol, float | int) and 0 < tail_tol < 1):
        raise ActdesignError(f"tail tolerance must be in (0, 1), got {tail_tol!r}")
    left, right = asymptotes(act)
    if weight is None:
        weight = Flat(*fit_domain(act, left, right, tail_tol))
    domain = weight.candidate_range
    problem = Problem(act, weight, domain, left, right)
    knots = _search(problem, 2**bits - 1)
    # One kink: the constraints fix a exactly. More: the least-squares solution.
    a = problem.constraint[:1] if bits == 1 else problem.solve(knots[None, :])[0][0]
    return _finish(problem, bits, knots, a)


def _search(problem: Problem, k: int) -> np.ndarray:
    slope_gap, offset_gap = problem.constraint
    if k == 1:
        if slope_gap == 0:
            raise ActdesignError(f"{problem.act.label}: one kink cannot join asymptotes of "
                                 "equal slope; use 2 or more bits")
        c = offset_gap / slope_gap
        if not problem.lo < c < problem.hi:
            raise ActdesignError(f"{problem.act.label}: the only 1-bit kink, {c:g}, lies "
                                 "outside the fit's domain")
        return np.array([c])
    points = np.linspace(problem.lo, problem.hi, SEARCH_POINTS + 2)[1:-1]
    if k == 3:
        starts = [_best_triple(problem, points)]
    else:
        previous = _search(problem, (k - 1) // 2)
        starts = [_embed(previous, k, problem), _density_start(problem, k),
                  np.linspace(problem.lo, problem.hi, k + 2)[1:-1]]
        starts = [_coordinate_descent(problem, s, points) for s in starts]
    refined = [_refine(problem, s) for s in starts]
    return min(refined, key=problem.objective)


def _best_triple(problem: Problem, points: np.ndarray) -> np.ndarray:
    best, best_value = None, np.inf
    triples = np.array(list(itertools.combinations(range(points.size), 3)))
    for chunk in np.array_split(triples, max(1, triples.shape[0] // 50_000)):
        _, values = problem.solve(points[chunk])
        i = int(np.argmin(values))
        if values[i] < best_value:
            best, best_value = points[chunk[i]], values[i]
    return best


def _embed(previous: np.ndarray, k: int, problem: Problem) -> np.ndarray:
    """The previous knots plus new ones halfway between and beyond them: the previous fit is
    feasible here (zero coefficients), so this start is never worse than it."""
    edges = np.concatenate([[problem.lo], previous, [problem.hi]])
    mids = 0.5 * (edges[:-1] + edges[1:])
    return np.sort(np.concatenate([previous, mids]))[:k]


def _density_start(problem: Problem, k: int) -> np.ndarray:
    """Knots at quantiles of (w·h''²)^(1/5), the asymptotically optimal knot density for
    linear interpolation in a weighted L2 norm."""
    xs = np.linspace(problem.lo, problem.hi, 4001)
    with np.errstate(all="ignore"):
        density = np.nan_to_num((problem.weight.pdf(xs) * problem.act.d2f(xs) ** 2) ** 0.2)
    cdf = np.cumsum(density) + 1e-12 * np.arange(xs.size)
    return np.interp((np.arange(k) + 0.5) / k * cdf[-1], cdf, xs)


def _coordinate_descent(problem: Problem, knots: np.ndarray, points: np.ndarray) -> np.ndarray:
    knots = np.array(knots, dtype=float)
    value = problem.objective(knots)
    for _ in range(200):
        moved = False
        for i in range(knots.size):
            lo = knots[i - 1] if i else -np.inf
            hi = knots[i + 1] if i + 1 < knots.size else np.inf
            options = points[(points > lo) & (points < hi)]
            if options.size == 0:
                continue
            batch = np.repeat(knots[None, :], options.size, axis=0)
            batch[:, i] = options
            _, values = problem.solve(batch)
            j = int(np.argmin(values))
            if values[j] < value * (1 - 1e-12):
                knots, value, moved = batch[j], values[j], True
        if not moved:
            break
    return knots


def _refine(problem: Problem, knots: np.ndarray) -> np.ndarray:
    """Continuous local refinement of the knots (Nelder-Mead; a never-worse result)."""
    from scipy.optimize import minimize

    start = problem.objective(knots)
    scale = (problem.hi - problem.lo) / SEARCH_POINTS
    simplex = np.vstack([knots] + [knots + scale * e for e in np.eye(knots.size)])
    result = minimize(problem.objective, knots, method="Nelder-Mead",
                      options={"initial_simplex": simplex, "xatol": 1e-10, "fatol": 1e-18,
                               "maxiter": 4000 * knots.size, "maxfev": 4000 * knots.size})
    return np.sort(result.x) if result.fun < start else knots


def _finish(problem: Problem, bits: int, knots: np.ndarray, a: np.ndarray) -> PwlFit:
    act, w = problem.act, problem.weight
    fit = PwlFit(act, w, bits, knots, a, problem.left, problem.right, 0.0, 0.0, 0.0,
                 (problem.lo, problem.hi))
    lo, hi = w.integration_range
    breaks = np.union1d(np.linspace(lo, hi, 257), knots[(knots > lo) & (knots < hi)])
    value, estimate = adaptive_integral(lambda x: (act.f(x) - fit(x)) ** 2 * w.pdf(x),
                                        breaks, rtol=1e-12, atol=1e-300)
    xs = np.union1d(np.linspace(problem.lo, problem.hi, 200_001), knots)
    max_abs = float(np.max(np.abs(act.f(xs) - fit(xs))))
    return PwlFit(act, w, bits, knots, a, problem.left, problem.right, float(value),
                  float(estimate), max_abs, (problem.lo, problem.hi))


def whole_line_objective(act: Activation, knots, coefficients, left) -> float:
    """∫ (h - h~)² over the whole line (the published objective), by adaptive quadrature."""
    knots = np.asarray(knots, dtype=float)
    fit = PwlFit(act, None, 0, knots, np.asarray(coefficients, dtype=float), left, left,
                 0.0, 0.0, 0.0, (-math.inf, math.inf))
    breaks = np.union1d(np.linspace(-200, 200, 801), knots)
    value, _ = adaptive_integral(lambda x: (act.f(x) - fit(x)) ** 2, breaks, rtol=1e-12,
                                 atol=1e-300)
    return float(value)
