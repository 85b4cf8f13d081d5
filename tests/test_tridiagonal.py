"""The tridiagonal solver against a dense solve, pivoting included."""

import numpy as np
import pytest

from actdesign.designer.tridiagonal import solve_tridiagonal


@pytest.mark.parametrize("n", [1, 2, 3, 5, 40])
@pytest.mark.parametrize("seed", range(5))
def test_matches_dense_solve(n, seed):
    rng = np.random.default_rng(seed)
    lower, upper = rng.normal(size=n - 1), rng.normal(size=n - 1)
    diag = rng.normal(size=n) * (0.01 if seed % 2 else 1.0)  # odd seeds force row swaps
    rhs = rng.normal(size=n)
    A = np.diag(diag) + np.diag(lower, -1) + np.diag(upper, 1)
    x = solve_tridiagonal(lower, diag, upper, rhs)
    # Backward-stable: the residual is a few ulps of |A|·|x|.
    residual = np.abs(A @ x - rhs).max()
    assert residual <= 1e-12 * (np.abs(A).sum(axis=1).max() * np.abs(x).max() + 1)
    np.testing.assert_allclose(x, np.linalg.solve(A, rhs), rtol=1e-8, atol=1e-10)


def test_singular_systems_are_reported():
    assert solve_tridiagonal([0.0], [0.0, 1.0], [0.0], [1.0, 1.0]) is None
    assert solve_tridiagonal([1.0], [1.0, 1.0], [1.0], [1.0, 2.0]) is None
