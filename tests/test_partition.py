"""The exact grid DP against brute force over every partition."""

import itertools

import numpy as np
import pytest

from actdesign.designer.partition import optimal_partition


def _cells(rng, n, zero_weight=0.0):
    """Random cell moments: weights (some zero), a non-monotone g, and in-cell variance."""
    w = rng.uniform(0.1, 1.0, n) * (rng.uniform(size=n) >= zero_weight)
    g = rng.normal(size=n) * 3 + np.sin(np.arange(n))
    v = rng.uniform(0, 0.2, n)
    return w, w * g, w * (g * g + v)


def _prefix(*cells):
    return [np.concatenate([[0.0], np.cumsum(c)]) for c in cells]


def _cost(W, F, S, j, i):
    dw = W[i] - W[j]
    return 0.0 if dw <= 0 else max(0.0, (S[i] - S[j]) - (F[i] - F[j]) ** 2 / dw)


def _brute(W, F, S, K):
    n = W.size - 1
    best = (np.inf, None)
    for inner in itertools.combinations(range(1, n), K - 1):
        cuts = (0, *inner, n)
        c = sum(_cost(W, F, S, a, b) for a, b in itertools.pairwise(cuts))
        best = min(best, (c, cuts), key=lambda t: t[0])
    return best


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
def test_dp_equals_brute_force(seed, K):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(K, 13))
    W, F, S = _prefix(*_cells(rng, n, zero_weight=0.25 if seed % 2 else 0.0))
    cuts, cost = optimal_partition(W, F, S, K)
    brute_cost, _ = _brute(W, F, S, K)
    assert cuts[0] == 0 and cuts[-1] == n and np.all(np.diff(cuts) > 0) and cuts.size == K + 1
    # The returned cuts realise the returned cost, and nothing beats it (round-off only).
    realised = sum(_cost(W, F, S, a, b) for a, b in itertools.pairwise(cuts))
    scale = S[-1] + 1.0
    assert realised == pytest.approx(cost, abs=1e-12 * scale)
    assert cost <= brute_cost + 1e-12 * scale
    assert cost == pytest.approx(brute_cost, abs=1e-12 * scale)


def test_every_cell_its_own_segment_costs_only_in_cell_variance():
    rng = np.random.default_rng(7)
    w, f, s = _cells(rng, 9)
    cuts, cost = optimal_partition(*_prefix(w, f, s), 9)
    assert cuts.tolist() == list(range(10))
    assert cost == pytest.approx(np.sum(s - f * f / w), rel=1e-12)


def test_exact_fit_costs_zero_and_finds_the_jump():
    # A step function sampled on cells: two segments fit it exactly, at the jump.
    g = np.array([0.0] * 7 + [1.0] * 5)
    w = np.ones_like(g)
    cuts, cost = optimal_partition(*_prefix(w, w * g, w * g * g), 2)
    assert cuts.tolist() == [0, 7, 12] and cost == 0.0


def test_refuses_more_segments_than_cells():
    with pytest.raises(ValueError):
        optimal_partition(*_prefix(np.ones(3), np.ones(3), np.ones(3)), 4)


def test_larger_problem_against_unpruned_dp():
    """The pruning is exact: compare with a plain O(K·N²) DP on a few hundred cells."""
    rng = np.random.default_rng(3)
    W, F, S = _prefix(*_cells(rng, 300, zero_weight=0.1))
    K = 8
    n = W.size - 1
    prev = np.array([_cost(W, F, S, 0, i) for i in range(n + 1)])
    for _ in range(2, K + 1):
        cur = np.full(n + 1, np.inf)
        for i in range(1, n + 1):
            js = np.arange(i)
            dw = W[i] - W[js]
            with np.errstate(divide="ignore", invalid="ignore"):
                c = np.where(dw > 0, (S[i] - S[js]) - (F[i] - F[js]) ** 2 / dw, 0.0)
            cur[i] = np.min(prev[js] + np.maximum(c, 0.0))
        prev = cur
    _, cost = optimal_partition(W, F, S, K)
    assert cost == pytest.approx(prev[n], rel=1e-10)
