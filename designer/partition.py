"""Exact optimal partition of a sequence of cells into K contiguous segments (numba DP).

Cell k carries the integrals w_k, f_k = ∫ g·w and s_k = ∫ g²·w. A segment's cost is its
weighted squared deviation from its weighted mean, S - F²/W, computed in O(1) from prefix
sums. The DP runs over (segments used, end cell) in O(K·N²) time and keeps O(K·N) memory for
the back-pointers; no N×N matrix is ever built.

Pruning, exact. Scanning the start j of the last segment downwards from i - 1: a segment's
cost is superadditive (merging two pieces adds their between-piece variance), so any start
j' < j costs at least D_k(j) + cost(j, i), where D_k(j) is the best k-segment cost of the
cells before j, already known for j < i. Once that bound reaches the best total found for i,
no smaller j can win.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _cost(W, F, S, j, i):
    dw = W[i] - W[j]
    if dw <= 0.0:
        return 0.0
    df = F[i] - F[j]
    c = (S[i] - S[j]) - df * df / dw
    return c if c > 0.0 else 0.0


@njit(cache=True, nogil=True)
def _first_level(W, F, S, cur):
    for i in range(1, W.size):
        cur[i] = _cost(W, F, S, 0, i)


@njit(cache=True, nogil=True)
def _next_level(W, F, S, prev, k, i_lo, i_hi, cur, back):
    """cur[i] = min over j of prev[j] + cost(j, i) for the k-th segment ending at cell i.

    cur must hold zeros where it is not computed: 0 is a valid lower bound there.
    """
    for i in range(i_lo, i_hi + 1):
        best = np.inf
        arg = -1
        for j in range(i - 1, k - 2, -1):
            c = _cost(W, F, S, j, i)
            if cur[j] + c >= best:
                break
            v = prev[j] + c
            if v < best:
                best = v
                arg = j
        cur[i] = best
        back[i] = arg


def optimal_partition(W, F, S, segments, progress=None):
    """Cut indices 0 = c_0 < c_1 < ... < c_K = N minimising Σ cost(c_{k-1}, c_k), and the cost.

    W, F, S are prefix sums (length N + 1, starting at 0). `progress(done, total)` is called
    after each segment level.
    """
    W, F, S = (np.ascontiguousarray(a, dtype=np.float64) for a in (W, F, S))
    n = W.size - 1
    K = int(segments)
    if not 1 <= K <= n:
        raise ValueError(f"cannot cut {n} cells into {K} non-empty segments")
    prev = np.full(n + 1, np.inf)
    _first_level(W, F, S, prev)
    back = np.zeros((K + 1, n + 1), dtype=np.int32)
    for k in range(2, K + 1):
        cur = np.zeros(n + 1)
        # Segment k must leave one cell for each later segment; the last one ends at n.
        i_lo, i_hi = (n, n) if k == K else (k, n - (K - k))
        _next_level(W, F, S, prev, k, i_lo, i_hi, cur, back[k])
        prev = cur
        if progress is not None:
            progress(k - 1, K - 1)
    cuts = [n]
    for k in range(K, 1, -1):
        cuts.append(int(back[k][cuts[-1]]))
    cuts.append(0)
    return np.array(cuts[::-1], dtype=np.int64), float(prev[n])
