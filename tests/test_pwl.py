"""Piecewise-linear fits (`--kind pwl`): constraints, objective, optimality, specs and ops."""

import itertools
import json

import numpy as np
import pytest
import torch
from scipy.integrate import quad

from actdesign import runtime, spec
from actdesign.activation import resolve
from actdesign.designer.pwl import asymptotes, fit_pwl, whole_line_objective
from actdesign.designer.weights import Normal
from actdesign.errors import ActdesignError

# The published 2-bit fits (LowMemoryBP's CUDA kernels): ReGELU2 and ReSiLU2, (a, c).
PUBLISHED = {
    "gelu": ([-0.04922261145617846, 1.0979632065417297, -0.048740595085551286],
             [-3.1858810036855245, -0.001178821281161997, 3.190832613414926]),
    "silu": ([-0.04060357190528599, 1.080925428529668, -0.040321856624382146],
             [-6.3050461001646445, -0.0008684942046214787, 6.325815242089708]),
}
FITS = {}


def fitted(name, bits, weight=None):
    key = (name, bits, weight)
    if key not in FITS:
        FITS[key] = fit_pwl(name, bits, weight)
    return FITS[key]


def direct_objective(fit):
    """∫ (h - h~)² w by scipy's quad, split at the knots: independent of the designer."""
    lo, hi = fit.weight.integration_range
    h = fit.activation.f
    pieces = np.concatenate([[lo], fit.knots[(fit.knots > lo) & (fit.knots < hi)], [hi]])
    total = 0.0
    for a, b in zip(pieces[:-1], pieces[1:], strict=True):
        total += quad(lambda x: float((h(x) - fit(x)) ** 2 * fit.weight.pdf(x)), a, b,
                      epsabs=1e-15, epsrel=1e-12, limit=200)[0]
    return total


def test_asymptotes_are_exact_limits():
    assert asymptotes(resolve("gelu")) == ((0.0, 0.0), (0.0, 1.0))
    assert asymptotes(resolve("elu")) == ((-1.0, 0.0), (0.0, 1.0))
    assert asymptotes(resolve("tanhshrink")) == ((1.0, 1.0), (-1.0, 1.0))
    assert asymptotes(resolve("leaky_relu")) == ((0.0, 0.01), (0.0, 1.0))
    for bad in ("x**2", "exp(x)", "x*sin(x)"):
        with pytest.raises(ActdesignError, match="no linear asymptote"):
            asymptotes(resolve(bad))


@pytest.mark.parametrize("name, bits", [("gelu", 1), ("gelu", 2), ("gelu", 3), ("silu", 2),
                                        ("elu", 2), ("sigmoid", 2), ("tanhshrink", 2)])
def test_constraints_hold_and_the_objective_is_honest(name, bits):
    fit = fitted(name, bits)
    (alpha, beta), (gamma, delta) = fit.left, fit.right
    a, c = fit.coefficients, fit.knots
    assert abs(a.sum() - (delta - beta)) <= 1e-12
    assert abs(a @ c - (alpha - gamma)) <= 1e-12 * (1 + np.abs(c).max())
    far = np.array([-1e3, 1e3])
    assert np.allclose(fit(far), [alpha + beta * -1e3, gamma + delta * 1e3], rtol=1e-12)
    assert fit.objective == pytest.approx(direct_objective(fit), rel=1e-9, abs=1e-14)
    assert np.all(np.diff(c) > 0)


def test_one_bit_is_the_only_feasible_kink():
    """Both asymptotes fix a single kink: a = δ - β and c = (α - γ)/a. Brute force over a
    fine grid of kinks finds no other one meeting them."""
    for name in ("gelu", "silu", "softplus", "elu"):
        fit = fitted(name, 1)
        (alpha, beta), (gamma, delta) = fit.left, fit.right
        kinks = np.linspace(*fit.domain, 100_001)
        feasible = kinks[np.abs((delta - beta) * kinks - (alpha - gamma)) < 1e-9]
        assert feasible.size <= 1
        assert fit.knots[0] == pytest.approx((alpha - gamma) / (delta - beta), abs=1e-15)
        assert fit.coefficients[0] == delta - beta


def test_two_bits_beat_a_brute_force_over_knot_triples():
    """Every triple of 15 grid knots, each fit solved independently (scipy quad moments and
    a KKT solve): none is better than the designer's fit."""
    fit = fitted("gelu", 2)
    h = fit.activation.f
    lo, hi = fit.domain
    grid = np.linspace(lo, hi, 17)[1:-1]

    def best_for(c):
        k = len(c)
        gram = np.array([[quad(lambda x, ci=ci, cj=cj: (x - ci) * (x - cj), max(ci, cj), hi)[0]
                          for cj in c] for ci in c])
        rhs = np.array([quad(lambda x, ci=ci: float(h(x)) * (x - ci), ci, hi,
                             epsabs=1e-13)[0] for ci in c])
        kkt = np.block([[gram, np.stack([np.ones(k), c], 1)],
                        [np.stack([np.ones(k), c]), np.zeros((2, 2))]])
        a = np.linalg.solve(kkt, np.concatenate([rhs, [1.0, 0.0]]))[:k]
        base = quad(lambda x: float(h(x)) ** 2, lo, hi, epsabs=1e-13)[0]
        return base - 2 * a @ rhs + a @ gram @ a

    brute = min(best_for(np.array(t)) for t in itertools.combinations(grid, 3))
    assert fit.objective <= brute


@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_more_bits_never_fit_worse(name):
    objectives = [fitted(name, bits).objective for bits in (1, 2, 3)]
    assert objectives[0] > objectives[1] > objectives[2]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_at_least_as_good_as_the_published_two_bit_fits(name):
    """Under the published objective, ∫ (h - h~)² over the whole line."""
    a, c = PUBLISHED[name]
    fit = fitted(name, 2)
    act = resolve(name)
    ours = whole_line_objective(act, fit.knots, fit.coefficients, fit.left)
    theirs = whole_line_objective(act, c, a, fit.left)
    assert ours < theirs
    assert ours == pytest.approx(fit.objective, rel=1e-8)  # the domain's tails are negligible


def test_weighted_fit():
    fit = fitted("mish", 2, Normal())
    assert fit.objective == pytest.approx(direct_objective(fit), rel=1e-9, abs=1e-15)
    assert fit.objective < fitted("mish", 1, Normal()).objective


@pytest.mark.parametrize("args, message", [
    (("x**2", 2), "no linear asymptote"),
    (("sigmoid", 1), "one kink cannot join"),
    (("gelu", 5), "bits in 1..4"),
])
def test_refusals(args, message):
    with pytest.raises(ActdesignError, match=message):
        fit_pwl(*args)


def test_spec_round_trip_and_checks():
    fit = fitted("gelu", 2)
    s = spec.from_pwl(fit)
    assert s.kind == "pwl" and list(s.borders) == list(fit.knots)
    data = json.loads(s.to_json())
    assert spec.loads(s.to_json()).to_dict() == data
    bad = json.loads(s.to_json())
    bad["levels"][2] += 1e-6
    with pytest.raises(ActdesignError, match="running sums"):
        spec.validate(bad)
    bad = json.loads(s.to_json())
    bad["pwl"]["c"][0] += 1e-3
    with pytest.raises(ActdesignError, match="must equal borders"):
        spec.validate(bad)
    del bad["pwl"]
    with pytest.raises(ActdesignError, match="needs a pwl object"):
        spec.validate(bad)


def test_the_op_of_a_pwl_spec_backpropagates_the_fit_slope():
    fit = fitted("gelu", 2)
    ops = runtime.load(spec.from_pwl(fit))
    x = torch.linspace(-5, 5, 1001, dtype=torch.float64, requires_grad=True)
    y = ops.apply(x)
    y.sum().backward()
    assert torch.equal(y.detach(), torch.nn.functional.gelu(x.detach()))  # h exact forward
    h = 1e-7
    slope = (fit(x.detach().numpy() + h) - fit(x.detach().numpy() - h)) / (2 * h)
    away = np.min(np.abs(x.detach().numpy()[:, None] - fit.knots), axis=1) > 1e-6
    assert np.allclose(x.grad.numpy()[away], slope[away], atol=1e-7)
