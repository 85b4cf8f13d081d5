"""Tridiagonal linear systems, by Gaussian elimination with partial pivoting (as LAPACK gtsv).

Newton's step in the refinement is tridiagonal: O(n) here instead of a dense O(n³) solve,
and no BLAS threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _gtsv(dl, d, du, b):
    n = d.size
    du2 = np.zeros(max(n - 2, 0))
    for i in range(n - 1):
        if abs(d[i]) >= abs(dl[i]):  # no interchange
            if d[i] == 0.0:
                return False
            fact = dl[i] / d[i]
            d[i + 1] -= fact * du[i]
            b[i + 1] -= fact * b[i]
        else:  # swap rows i and i+1
            fact = d[i] / dl[i]
            d[i] = dl[i]
            temp = d[i + 1]
            d[i + 1] = du[i] - fact * temp
            if i < n - 2:
                du2[i] = du[i + 1]
                du[i + 1] = -fact * du2[i]
            du[i] = temp
            temp = b[i]
            b[i] = b[i + 1]
            b[i + 1] = temp - fact * b[i + 1]
    if d[n - 1] == 0.0:
        return False
    b[n - 1] /= d[n - 1]
    if n > 1:
        b[n - 2] = (b[n - 2] - du[n - 2] * b[n - 1]) / d[n - 2]
    for i in range(n - 3, -1, -1):
        b[i] = (b[i] - du[i] * b[i + 1] - du2[i] * b[i + 2]) / d[i]
    return True


def solve_tridiagonal(lower, diag, upper, rhs):
    """x with A x = rhs, A having `diag` on its diagonal, `lower` below and `upper` above.

    Returns None when A is singular.
    """
    dl, d, du, x = (np.array(a, dtype=np.float64) for a in (lower, diag, upper, rhs))
    if d.size == 0:
        return x
    return x if _gtsv(dl, d, du, x) else None
