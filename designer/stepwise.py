"""Optimal few-bit derivative tables: min ∫ (f'(x) - q(x))² w(x) dx over step functions q.

Two stages:
1. the exact global optimum over a grid of candidate borders (`partition.optimal_partition`);
2. continuous refinement from there to the stationarity conditions, by Newton's method:
   each border t_i has f'(t_i) = (y_i + y_{i+1}) / 2 and each level y_i is its interval's
   weighted mean. A border that sits on a jump of f' is stationary when the jump brackets
   the mean of its two levels.
The reported error is an adaptive quadrature of the final table, not the grid sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actdesign.activation import Activation, resolve
from actdesign.errors import ActdesignError

from .partition import optimal_partition
from .quadrature import adaptive_integral, interval_moments
from .tridiagonal import solve_tridiagonal
from .weights import Normal

MAX_BITS = 8
MAX_GRID = 2**16
_EPS = np.finfo(float).eps


def default_grid(bits: int) -> int:
    """Candidate-grid cells: at least 32 per level and never under 2048. Up to 6 bits this
    ends in the same table as grids 8 times finer for every built-in tested; at 7-8 bits some
    activations have near-equal local optima (within 1e-4 of E) that only finer grids tell
    apart (see benchmarks/RESULTS.md)."""
    return max(2048, 32 * 2**bits)


@dataclass(frozen=True, eq=False)
class StepwiseFit:
    """A fitted table and how good it is."""

    activation: Activation
    weight: object
    bits: int
    borders: np.ndarray  # 2**bits - 1, strictly ascending
    levels: np.ndarray  # 2**bits
    error: float  # E = ∫ (f' - q)² w, adaptive quadrature
    error_estimate: float  # the quadrature's own error bound on E
    reference: float  # ∫ f'² w, so error / reference is the relative error
    grid_error: float  # E of the grid optimum (stage 1), same quadrature
    grid_borders: np.ndarray  # the grid optimum's borders
    grid_size: int  # the stage-1 grid's size, as passed to `grid` (reproduces the fit)
    stationarity: float  # max |f'(t_i) - (y_i + y_{i+1})/2| over borders where it applies
    iterations: int  # Newton iterations in stage 2

    @property
    def relative_error(self) -> float:
        return self.error / self.reference if self.reference > 0 else 0.0


class Problem:
    """f' of an activation under a weight, with the split points quadrature must respect."""

    def __init__(self, activation: Activation, weight):
        self.activation = activation
        self.weight = weight
        self.g = activation.df
        self.dg = activation.d2f
        self.pdf = weight.pdf
        a, b = weight.integration_range
        self.range = (float(a), float(b))
        self.jumps = activation.breakpoints(a, b)
        lo, hi = weight.candidate_range
        # Gauss-Legendre pieces: 512 across the candidate range, 32 across each tail, so
        # every piece is smooth and short enough for 16-point rules to reach round-off.
        resolution = [np.linspace(lo, hi, 513), np.linspace(a, lo, 33), np.linspace(hi, b, 33)]
        splits = np.union1d(self.jumps, weight.breakpoints)
        self.mesh = np.union1d(splits, np.concatenate(resolution))
        probe = self.mesh[self.pdf(self.mesh) > 0]
        for fn, what in ((activation.f, "f(x)"), (self.g, "f'(x)")):
            bad = ~np.isfinite(fn(probe))
            if bad.any():
                raise ActdesignError(f"{what} of {activation.label} is not finite at "
                                     f"x = {probe[bad][0]:.6g}, where the weight is positive")

    def grid(self, cells: int) -> np.ndarray:
        """Candidate borders, about `cells` + 1 of them over the candidate range, in two halves:
        - uniform, mirror-symmetric about the centre of the range;
        - adaptive, at the quantiles of the high-resolution border density (w·f''²)^(1/3),
          so each level gets a similar number of candidates wherever the levels crowd;
        and every jump of f' inserted exactly."""
        lo, hi = self.weight.candidate_range
        c, h = 0.5 * (lo + hi), 0.5 * (hi - lo)
        n_uniform = 2 * (cells // 4)
        half = np.arange(n_uniform // 2 + 1) * (2.0 / n_uniform)
        pts = c + h * np.concatenate([-half[::-1], half[1:]])
        x = np.linspace(lo, hi, 16 * cells + 1)
        with np.errstate(all="ignore"):
            density = np.nan_to_num(np.cbrt(self.pdf(x) * self.dg(x) ** 2), posinf=0.0)
        mass = np.concatenate([[0.0], np.cumsum(0.5 * (density[1:] + density[:-1]))])
        if mass[-1] > 0:
            quantiles = np.arange(1, cells - n_uniform) / (cells - n_uniform) * mass[-1]
            pts = np.union1d(pts, np.interp(quantiles, mass, x))
        step = 2 * h / cells
        jumps = self.jumps[(self.jumps > lo) & (self.jumps < hi)]
        if jumps.size:
            near = np.abs(pts[:, None] - jumps[None, :]).min(axis=1) < 1e-6 * step
            pts = np.union1d(pts[~near], jumps)
        a, b = self.range
        return pts[(pts > a) & (pts < b)]

    def moments(self, borders, mesh=None, shift=0.0):
        cuts = np.concatenate([[self.range[0]], borders, [self.range[1]]])
        return interval_moments(self.g, self.pdf, cuts,
                                self.mesh if mesh is None else mesh, shift)

    def levels(self, borders):
        W, F, _ = self.moments(borders)
        return self.means(borders, W, F)

    def means(self, borders, W, F):
        """Weighted means; an interval without weight takes f' at its midpoint."""
        cuts = np.concatenate([[self.range[0]], borders, [self.range[1]]])
        mid = self.g(0.5 * (cuts[:-1] + cuts[1:]))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(W > 0, F / np.where(W > 0, W, 1.0), np.nan_to_num(mid))

    def error(self, borders, levels):
        """(E, error estimate) by adaptive quadrature of (f' - q)² w."""
        borders = np.asarray(borders, dtype=float)
        levels = np.asarray(levels, dtype=float)

        def integrand(x):
            q = levels[np.searchsorted(borders, x, side="right")]
            w = self.pdf(x)
            with np.errstate(all="ignore"):
                return np.where(w > 0, (self.g(x) - q) ** 2 * w, 0.0)

        return adaptive_integral(integrand, self._breaks(borders), atol=1e-300)

    def reference(self):
        def integrand(x):
            w = self.pdf(x)
            with np.errstate(all="ignore"):  # a divergent integral is reported below
                return np.where(w > 0, self.g(x) ** 2 * w, 0.0)

        value, bound = adaptive_integral(integrand, self._breaks(np.empty(0)), atol=1e-300)
        if not (np.isfinite(value) and bound <= 1e-6 * abs(value) + 1e-300):
            raise ActdesignError(f"the integral of f'(x)^2 w(x) for {self.activation.label} "
                                 "does not converge under this weight")
        return value

    def _breaks(self, borders):
        a, b = self.range
        pts = np.union1d(np.union1d(self.mesh, borders), np.linspace(a, b, 65))
        return pts[(pts >= a) & (pts <= b)]


def fit_stepwise(activation: Activation | str, bits: int, weight=None,
                 grid: int | None = None, progress=None) -> StepwiseFit:
    """The optimal b-bit step function for f' under `weight` (default N(0, 1)).

    `activation` is an Activation, a built-in name or an expression in x. `progress(done,
    total)` is called as the grid DP completes each level.
    """
    if isinstance(activation, str):
        activation = resolve(activation)
    bits = _integer("bits", bits, 1, MAX_BITS)
    weight = Normal() if weight is None else weight
    levels_count = 2**bits
    cells = _integer("grid", default_grid(bits) if grid is None else grid, 2 * levels_count,
                     MAX_GRID)
    problem = Problem(activation, weight)
    reference = problem.reference()

    # Stage 1: exact optimum over the grid.
    candidates = problem.grid(cells)
    grid_borders = grid_optimum(problem, candidates, levels_count, progress)
    grid_levels = problem.levels(grid_borders)
    grid_error, grid_err_est = problem.error(grid_borders, grid_levels)

    # Stage 2: Newton refinement to the stationarity conditions.
    borders, iterations, stationarity = refine(problem, grid_borders)
    levels = problem.levels(borders)
    error, err_est = problem.error(borders, levels)
    if not error <= grid_error:  # refinement never makes things worse
        borders, levels, error, err_est = grid_borders, grid_levels, grid_error, grid_err_est
        stationarity = _worst(residuals(problem, borders))
    return StepwiseFit(activation, weight, bits, borders, levels, error, err_est,
                       reference, grid_error, grid_borders, cells,
                       stationarity, iterations)


def _integer(name, value, lo, hi) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or \
            not lo <= value <= hi:
        raise ActdesignError(f"{name} must be an integer in {lo}..{hi}, got {value!r}")
    return int(value)


def grid_prefix_sums(problem: Problem, candidates: np.ndarray):
    """The DP's input for a candidate grid: its cuts, and prefix sums of W, F, S per cell."""
    cuts = np.concatenate([[problem.range[0]], candidates, [problem.range[1]]])
    mesh = np.union1d(problem.mesh, cuts)
    # Centre f' on its mean first: smaller prefix sums, less cancellation in S - F²/W.
    W0, F0, _ = problem.moments(candidates, mesh=mesh)
    W, F, S = problem.moments(candidates, mesh=mesh, shift=float(F0.sum() / W0.sum()))
    return cuts, [np.concatenate([[0.0], np.cumsum(m)]) for m in (W, F, S)]


def grid_optimum(problem: Problem, candidates: np.ndarray, segments: int, progress=None):
    """The exact best borders among `candidates`, by the DP over the cells they cut."""
    cuts, prefix = grid_prefix_sums(problem, candidates)
    index, _ = optimal_partition(*prefix, segments, progress)
    return cuts[index[1:-1]]


def residuals(problem: Problem, t: np.ndarray):
    """r_i = f'(t_i) - (y_i + y_{i+1})/2, and where it applies (`active`): not at borders in
    zero weight, nor at borders on a jump of f' that brackets the mean of their levels,
    which are stationary as they stand."""
    W, F, _ = problem.moments(t)
    y = problem.means(t, W, F)
    gt = problem.g(t)
    mid = 0.5 * (y[:-1] + y[1:])
    r = gt - mid
    wt = problem.pdf(t)
    active = (wt > 0) & (W[:-1] > 0) & (W[1:] > 0)
    on_jump = np.isin(t, problem.jumps)
    if on_jump.any():
        tj = t[on_jump]
        delta = 8 * _EPS * np.maximum(1.0, np.abs(tj))
        left, right = problem.g(tj - delta) - mid[on_jump], problem.g(tj + delta) - mid[on_jump]
        bracketed = left * right <= 0
        idx = np.nonzero(on_jump)[0][bracketed]
        active[idx] = False
    return r, active, y, W, wt, gt


def refine(problem: Problem, borders: np.ndarray, max_iter: int = 100):
    """Newton's method on the stationarity residuals, with backtracking on ||r||.

    Steps keep the borders strictly ascending and stop on a jump of f' rather than cross it.
    Each line search compares residuals over the same borders: those active where it starts.
    Returns (borders, iterations, final max |r| over active borders).
    """
    t = np.asarray(borders, dtype=float).copy()
    if t.size == 0:
        return t, 0, 0.0
    g_scale = float(np.max(np.abs(problem.g(problem.grid(256)))))
    tol = 64 * _EPS * max(g_scale, 1e-300)
    state = residuals(problem, t)
    steps = 0
    lo, hi = problem.range
    while steps < max_iter and _worst(state) > tol:
        step = _newton_step(problem, t, state)
        if step is None:
            break
        mask = state[1]
        merit = float(np.linalg.norm(state[0][mask]))
        for alpha in 0.5 ** np.arange(40):
            cand = _move(t, alpha * step, problem.jumps)
            if not (np.all(np.diff(cand) > 0) and cand[0] > lo and cand[-1] < hi):
                continue
            cand_state = residuals(problem, cand)
            cand_merit = float(np.linalg.norm(cand_state[0][mask]))
            if cand_merit < merit:
                break
        else:
            break  # no step length helps: rounding floor, or a nearly singular Jacobian
        stalled = cand_merit > 0.5 * merit and _worst(state) < 1e3 * tol  # rounding noise
        t, state = cand, cand_state
        steps += 1
        if stalled:
            break
    return t, steps, _worst(state)


def _worst(state) -> float:
    r, active = state[0], state[1]
    return float(np.max(np.abs(r[active]), initial=0.0))


def _newton_step(problem, t, state):
    """Solve J Δ = -r for the tridiagonal Jacobian of the residuals. Borders whose residual is
    zero by rule (see `residuals`), or whose row vanishes (a flat stretch of f' with equal
    levels on both sides), keep their place."""
    r, active, y, W, wt, gt = state
    with np.errstate(invalid="ignore", divide="ignore"):
        dy_left = np.where(W[:-1] > 0, wt * (gt - y[:-1]) / W[:-1], 0.0)  # ∂y_i/∂t_i
        dy_right = np.where(W[1:] > 0, -wt * (gt - y[1:]) / W[1:], 0.0)  # ∂y_{i+1}/∂t_i
    diag = problem.dg(t) - 0.5 * (dy_left + dy_right)
    lower = -0.5 * dy_right[:-1]  # ∂r_i/∂t_{i-1}, for i >= 1
    upper = -0.5 * dy_left[1:]  # ∂r_i/∂t_{i+1}, for i < m - 1
    row = np.abs(diag) + np.concatenate([[0.0], np.abs(lower)]) \
        + np.concatenate([np.abs(upper), [0.0]])
    fixed = ~active | (row <= 1e-300)
    if fixed.all() or not np.all(np.isfinite(row)):
        return None
    diag = np.where(fixed, 1.0, diag)
    lower = np.where(fixed[1:], 0.0, lower)
    upper = np.where(fixed[:-1], 0.0, upper)
    return solve_tridiagonal(lower, diag, upper, np.where(fixed, 0.0, -r))


def _move(t, step, jumps):
    """t + step, except that a border whose move would cross a jump of f' stops on it."""
    new = t + step
    if jumps.size:
        lo, hi = np.minimum(t, new), np.maximum(t, new)
        first = np.searchsorted(jumps, lo, side="right")  # first jump > lo
        last = np.searchsorted(jumps, hi, side="left") - 1  # last jump < hi
        crossing = first <= last
        if crossing.any():
            up = new > t
            stop_up = jumps[np.clip(first, 0, jumps.size - 1)]
            stop_down = jumps[np.clip(last, 0, jumps.size - 1)]
            new = np.where(crossing, np.where(up, stop_up, stop_down), new)
    return new
