"""The stepwise designer: optimality against brute force, stationarity, symmetry, edge cases.

Integrals here use scipy.integrate.quad, independent of the designer's own quadrature.
"""

import itertools
import math
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
from scipy import integrate

from actdesign import ActdesignError
from actdesign.activation import resolve
from actdesign.designer import Histogram, Normal, Uniform, fit_stepwise
from actdesign.designer.stepwise import Problem

SMOOTH = ["gelu", "silu", "tanh", "sigmoid", "mish", "softplus", "gelu_tanh"]


def _quad(fn, edges):
    """∫ fn over the union of consecutive [edges[k], edges[k+1]] (infinite ends allowed).

    Relative 1e-10, or absolute 1e-17 per piece: far below 1e-9 of any integral compared
    here (all above 1e-7). A piece whose exact integral is 0 (a linear f' integrated across
    its root) trips quad's round-off detector although its absolute error is ~1e-17."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        return sum(integrate.quad(fn, a, b, epsabs=1e-17, epsrel=1e-10, limit=400)[0]
                   for a, b in itertools.pairwise(edges) if b > a)


def _edges(fit, lo=-np.inf, hi=np.inf):
    jumps = fit.activation.breakpoints(-50, 50).tolist()
    return sorted(set([lo, hi, *fit.borders.tolist(), *jumps]))


def _independent_error(fit, lo=-np.inf, hi=np.inf):
    g, w = fit.activation.df, fit.weight.pdf
    q = np.asarray(fit.levels)

    def integrand(x):
        xa = np.array([x])
        return float((g(xa)[0] - q[np.searchsorted(fit.borders, x, side="right")]) ** 2
                     * w(xa)[0])

    return _quad(integrand, _edges(fit, lo, hi))


def _interval_means(act, weight, borders, lo, hi):
    edges = np.concatenate([[lo], borders, [hi]])
    out = []
    for a, b in itertools.pairwise(edges):
        inner = [a, *[j for j in act.breakpoints(-50, 50) if a < j < b], b]
        mass = _quad(lambda x: float(weight.pdf(np.array([x]))[0]), inner)
        first = _quad(lambda x: float((act.df(np.array([x])) * weight.pdf(np.array([x])))[0]),
                      inner)
        out.append(first / mass)
    return np.array(out)


def test_grid_stage_is_brute_force_optimal_on_its_grid():
    """Every choice of 3 borders among 13 candidates, scored with scipy quad: the DP's pick is
    the best, and its error is the smallest."""
    act, weight = resolve("gelu"), Normal()
    fit = fit_stepwise(act, 2, weight, grid=12)
    candidates = Problem(act, weight).grid(12)
    best = (np.inf, None)
    g, w = act.df, weight.pdf
    for chosen in itertools.combinations(candidates, 3):
        borders = np.array(chosen)
        levels = _interval_means(act, weight, borders, -np.inf, np.inf)

        def integrand(x, b=borders, y=levels):
            xa = np.array([x])
            return float((g(xa)[0] - y[np.searchsorted(b, x, side="right")]) ** 2 * w(xa)[0])

        err = _quad(integrand, [-np.inf, *chosen, np.inf])
        best = min(best, (err, chosen), key=lambda t: t[0])
    assert fit.grid_error == pytest.approx(best[0], rel=1e-9)
    # The refined table is better than the best any grid point allows.
    assert fit.error < best[0]


def _residual(act, t, y):
    """max |f'(t_i) - (y_i + y_{i+1})/2|, taken as 0 where f' jumps across that mean."""
    mid = 0.5 * (y[:-1] + y[1:])
    d = 1e-9 * np.maximum(1, np.abs(t))
    left, right = act.df(t - d) - mid, act.df(t + d) - mid
    on_jump = np.isin(t, act.breakpoints(-50, 50)) & (left * right <= 0)
    return np.where(on_jump, 0.0, np.abs(act.df(t) - mid)).max(initial=0.0)


@pytest.mark.parametrize("weight", [Normal(), Uniform(-4.0, 4.0), Normal(0.5, 2.0)],
                         ids=["normal", "uniform", "normal(0.5,2)"])
@pytest.mark.parametrize("name", SMOOTH + ["hardswish", "elu"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_refined_table_is_stationary_and_beats_the_grid(name, bits, weight):
    act = resolve(name)
    fit = fit_stepwise(act, bits, weight)
    t, y = fit.borders, fit.levels
    assert np.all(np.diff(t) > 0) and np.all(np.isfinite(y))
    lo, hi = weight.integration_range
    # Each level is its interval's weighted mean (two quadratures at rel. 1e-10 each).
    np.testing.assert_allclose(y, _interval_means(act, weight, t, lo, hi), rtol=1e-9, atol=1e-12)
    # Each border: f'(t) is the mean of its levels, or f' jumps across that mean.
    scale = np.max(np.abs(act.df(np.linspace(lo, hi, 1001))))
    assert _residual(act, t, y) <= 1e-11 * scale
    # Better than the grid optimum, strictly so unless the grid optimum was stationary already;
    # the reported E is the true integral.
    grid_levels = _interval_means(act, weight, fit.grid_borders, lo, hi)
    grid_stationary = _residual(act, fit.grid_borders, grid_levels) <= 1e-11 * scale
    assert fit.error < fit.grid_error or (grid_stationary and fit.error == fit.grid_error)
    assert fit.error == pytest.approx(_independent_error(fit, lo, hi), rel=1e-9)
    assert fit.relative_error == pytest.approx(fit.error / fit.reference, rel=1e-15)


@pytest.mark.parametrize("name", SMOOTH + ["hardswish"])
def test_error_decreases_strictly_with_bits(name):
    errors = [fit_stepwise(resolve(name), b).error for b in range(1, 9)]
    assert all(b < a for a, b in itertools.pairwise(errors)), errors


@pytest.mark.parametrize("name,bits", [("relu", 1), ("leaky_relu", 1), ("relu6", 2),
                                       ("hardtanh", 2), ("relu", 8)])
def test_piecewise_constant_derivatives_are_exact(name, bits):
    fit = fit_stepwise(resolve(name), bits)
    assert fit.error == 0.0
    assert np.all(np.diff(fit.borders) > 0) and np.all(np.isfinite(fit.levels))


def test_one_bit_relu():
    fit = fit_stepwise(resolve("relu"), 1)
    assert fit.borders.tolist() == [0.0] and fit.levels.tolist() == [0.0, 1.0]


# --- symmetry ------------------------------------------------------------------------------

@dataclass(frozen=True)
class HalfNormal:
    """N(0, 1) folded onto [0, inf): the symmetric sub-problem of a symmetric table."""

    integration_range = (0.0, 40.0)
    candidate_range = (0.0, 6.0)
    breakpoints = np.empty(0)

    def pdf(self, x):
        x = np.asarray(x, dtype=float)
        return np.where(x >= 0, 2 * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi), 0.0)


def _mirror(fit, odd_center):
    """The mirror image of a table: x -> -x, with levels reflected about odd_center
    (odd f' - c) or kept (even f')."""
    t = -fit.borders[::-1]
    y = fit.levels[::-1]
    return t, (2 * odd_center - y if odd_center is not None else y)


@pytest.mark.parametrize("name,odd_center", [("gelu", 0.5), ("silu", 0.5), ("tanh", None),
                                             ("sigmoid", None), ("softsign", None),
                                             ("hardswish", 0.5)])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_symmetric_problems(name, odd_center, bits):
    act = resolve(name)
    x = np.linspace(-5, 5, 101)
    expected = 2 * odd_center - act.df(x) if odd_center is not None else act.df(x)
    np.testing.assert_allclose(act.df(-x), expected, atol=1e-12)  # the symmetry holds
    fit = fit_stepwise(act, bits, Normal())
    # 1. The mirror image is an equally good table.
    t, y = _mirror(fit, odd_center)
    problem = Problem(act, Normal())
    mirrored_error, _ = problem.error(t, y)
    assert mirrored_error == pytest.approx(fit.error, rel=1e-10)
    # 2. The best symmetric table: a border at 0 and, on [0, inf), the best table with half
    #    the levels (each half costs the same). Nothing beats the global optimum.
    symmetric_error = fit_stepwise(act, bits - 1, HalfNormal()).error if bits > 1 else None
    if bits == 1:
        symmetric_error, _ = problem.error(np.array([0.0]), problem.levels(np.array([0.0])))
    assert fit.error <= symmetric_error * (1 + 1e-9)
    is_symmetric = np.allclose(t, fit.borders, atol=1e-7) and np.allclose(y, fit.levels,
                                                                          atol=1e-7)
    if symmetric_error <= fit.error * (1 + 1e-9):
        assert is_symmetric  # the optimum is symmetric, and so is what we found
    else:
        assert not is_symmetric  # an asymmetric optimum; its mirror is the other one


def test_gelu_four_bits_has_an_asymmetric_optimum():
    act = resolve("gelu")
    fit = fit_stepwise(act, 4)
    symmetric = fit_stepwise(act, 3, HalfNormal())
    assert fit.error < symmetric.error * (1 - 1e-6)
    assert not np.allclose(-fit.borders[::-1], fit.borders, atol=1e-3)


# --- weights and edge cases ----------------------------------------------------------------

def test_empirical_weight_approaches_the_normal_fit():
    rng = np.random.default_rng(0)
    hist = Histogram.from_values(rng.standard_normal(1_000_000), "normal samples")
    empirical = fit_stepwise(resolve("gelu"), 3, hist)
    exact = fit_stepwise(resolve("gelu"), 3, Normal())
    # Sampling error of a 10^6-sample histogram, well inside a few percent of a level width.
    np.testing.assert_allclose(empirical.borders, exact.borders, atol=0.02)
    assert empirical.error == pytest.approx(exact.error, rel=0.03)


def test_zero_weight_tails_and_gaps():
    """Two separated clusters: no weight between or beyond them. Nothing is NaN, borders are
    ordered, and adding bits still helps."""
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.uniform(-3, -2, 50_000), rng.uniform(1, 2.5, 50_000)])
    hist = Histogram.from_values(values)
    errors = []
    for bits in (1, 2, 3, 6):
        fit = fit_stepwise(resolve("silu"), bits, hist)
        assert np.all(np.diff(fit.borders) > 0)
        assert np.all(np.isfinite(fit.borders)) and np.all(np.isfinite(fit.levels))
        assert fit.error <= fit.grid_error
        errors.append(fit.error)
    assert all(b < a for a, b in itertools.pairwise(errors))


def test_constant_derivative_needs_no_levels():
    fit = fit_stepwise(resolve("2*x + 1"), 3)
    assert fit.error == 0.0 and np.allclose(fit.levels, 2.0)
    assert np.all(np.diff(fit.borders) > 0)


def test_uniform_domain_narrower_than_the_features():
    fit = fit_stepwise(resolve("hardswish"), 2, Uniform(3.5, 9.0))  # f' == 1 throughout
    assert fit.error == 0.0 and np.allclose(fit.levels, 1.0)
    assert fit.borders.min() > 3.5 and fit.borders.max() < 9.0


def test_bad_arguments():
    act = resolve("gelu")
    for bits in (0, 9, 2.0, True):
        with pytest.raises(ActdesignError, match="bits"):
            fit_stepwise(act, bits)
    with pytest.raises(ActdesignError, match="grid"):
        fit_stepwise(act, 8, grid=100)
    with pytest.raises(ActdesignError, match="domain"):
        Uniform(1.0, 1.0)
    with pytest.raises(ActdesignError, match="std"):
        Normal(0.0, -1.0)
    with pytest.raises(ActdesignError, match="not finite"):
        fit_stepwise(resolve("log(x)"), 2)
    with pytest.raises(ActdesignError, match="does not converge"):
        fit_stepwise(resolve("exp(x**2/4)"), 2)  # ∫ f'² φ diverges


def test_progress_reports_every_level():
    calls = []
    fit_stepwise(resolve("gelu"), 3, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(k, 7) for k in range(1, 8)]


@pytest.mark.parametrize("name,weight", [("gelu", Normal()), ("silu", Uniform(-8.0, 8.0)),
                                         ("hardswish", Uniform(-8.0, 8.0)),
                                         ("sigmoid", Normal(1.0, 2.0))],
                         ids=["gelu-normal", "silu-uniform", "hardswish-uniform",
                              "sigmoid-normal"])
@pytest.mark.parametrize("bits", [3, 5, 6])
def test_default_grid_reaches_the_same_optimum_as_a_finer_one(name, weight, bits):
    """The default grid already starts refinement in the global optimum's basin: a grid four
    times finer ends at the same table, to rounding; both are stationary to rounding."""
    act = resolve(name)
    default = fit_stepwise(act, bits, weight)
    finer = fit_stepwise(act, bits, weight, grid=4 * default.grid_size)
    assert default.error == pytest.approx(finer.error, rel=1e-12)
    np.testing.assert_allclose(default.borders, finer.borders, atol=1e-9)
    scale = np.max(np.abs(act.df(np.linspace(-8, 8, 1001))))
    assert max(default.stationarity, finer.stationarity) <= 1e-12 * scale


def test_histogram_density_is_a_continuous_normalised_polygon():
    rng = np.random.default_rng(2)
    hist = Histogram.from_values(rng.gamma(2.0, size=20_000))
    lo, hi = hist.integration_range
    inner = [lo, *hist.breakpoints, hi]
    assert _quad(lambda x: float(hist.pdf(np.array([x]))[0]), inner) == pytest.approx(1, rel=1e-9)
    for x in rng.uniform(lo, hi, 5):
        below = [lo, *hist.breakpoints[hist.breakpoints < x], x]
        mass = _quad(lambda v: float(hist.pdf(np.array([v]))[0]), below)
        assert float(hist.cdf(np.array([x]))[0]) == pytest.approx(mass, rel=1e-9, abs=1e-15)
    # Continuous inside the edges: no jump at any corner.
    corners = hist.breakpoints
    step = 1e-9 * (hi - lo)
    np.testing.assert_allclose(hist.pdf(corners - step), hist.pdf(corners + step), rtol=1e-6,
                               atol=1e-9 * hist.pdf(corners).max())


def test_empirical_weights_refine_to_rounding_at_high_bits():
    hist = Histogram.from_values(np.random.default_rng(0).standard_t(4, 200_000))
    for name in ("gelu", "hardswish"):
        fit = fit_stepwise(resolve(name), 7, hist)
        assert fit.stationarity <= 1e-13 and fit.error < fit.grid_error
