"""Variance-optimal bit allocation (ActNN): choose b_i in 1..8 for every item to

    minimise Σ C_i / (2^b_i - 1)²   subject to   Σ w_i b_i <= T,

exactly, also for unequal weights.

Start every item at 1 bit. Raising item i from b to b + 1 costs w_i of budget and saves
Δ_i(b) = C_i (f(b) - f(b + 1)), f(b) = 1/(2^b - 1)². Δ_i falls with b, so an item's raises are
taken in order, and the problem is a 0-1 knapsack over the 7n raises.
1. The fractional (LP) optimum takes raises by efficiency Δ/w; the first that does not fit sets
   the multiplier λ. Its value U bounds every integer solution: any selection x is worth
   U - Σ_flipped |Δ - λw| - λ·(unused budget), where "flipped" are the raises x sets against
   the LP (a reduced-cost argument).
2. A greedy integer solution (the LP order, skipping raises that do not fit) gives V <= U.
3. An expanding core: raises are visited in order of |Δ - λw|, each either kept on its LP side
   or flipped, over Pareto-optimal (weight, value) states pruned by the bound in 1. A raise
   whose |Δ - λw| exceeds U - V cannot be flipped by anything better than V, so the search
   stops there, and the best state is optimal.
The published method is a heap greedy; `greedy_heap` reproduces it for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from actdesign.errors import ActdesignError

MAX_BITS = 8
_F = np.array([1.0 / (2.0**b - 1) ** 2 for b in range(1, MAX_BITS + 1)])  # f(1..8)


@dataclass(frozen=True)
class Allocation:
    bits: np.ndarray  # int, 1..8 per item
    variance: float  # Σ C_i f(b_i)
    budget: float  # T
    used: float  # Σ w_i b_i
    lp_gap: float  # the LP bound minus the optimum's value (0: the LP optimum was integral)
    core: int  # raises the exact stage examined


def variance(C, bits) -> float:
    return float(np.sum(np.asarray(C, dtype=float) * _F[np.asarray(bits) - 1]))


def _validate(C, w, budget):
    C = np.asarray(C, dtype=float).reshape(-1)
    w = np.asarray(w, dtype=float).reshape(-1)
    if C.shape != w.shape or C.size == 0:
        raise ActdesignError("allocation needs the same positive number of C and w values")
    if not (np.all(np.isfinite(C)) and np.all(C >= 0)):
        raise ActdesignError("every C must be finite and >= 0")
    if not (np.all(np.isfinite(w)) and np.all(w > 0)):
        raise ActdesignError("every weight w must be finite and > 0")
    if not np.isfinite(budget) or budget < w.sum() * (1 - 1e-12):
        raise ActdesignError(f"the budget {budget:g} is below 1 bit for every item "
                             f"({w.sum():g})")
    return C, w, float(budget)


def _raises(C, w):
    """Per raise (item, step): value Δ, weight w, in decreasing efficiency (ties: lower step)."""
    delta = C[:, None] * (_F[:-1] - _F[1:])[None, :]  # (n, 7)
    eff = delta / w[:, None]
    order = np.lexsort((np.tile(np.arange(MAX_BITS - 1), C.size), -eff.reshape(-1)))
    item = order // (MAX_BITS - 1)
    return item, delta.reshape(-1)[order], w[item], eff.reshape(-1)[order]


@numba.njit(cache=True)
def _greedy_fill(item, weight, capacity, n):
    """Take raises in order while they fit; an item stops at its first raise that does not."""
    take = np.zeros(item.size, dtype=np.bool_)
    closed = np.zeros(n, dtype=np.bool_)
    used = 0.0
    for k in range(item.size):
        i = item[k]
        if closed[i]:
            continue
        if used + weight[k] <= capacity:
            take[k] = True
            used += weight[k]
        else:
            closed[i] = True
    return take


@numba.njit(cache=True)
def _flip_step(fw, fv, dw, dv, cap, upper, lam, next_cost, best):
    """One raise of the expanding core: every state (weight, value) either keeps the raise on
    its LP side or flips it (dw, dv). Keeps the Pareto-optimal states that can still beat
    best: a state's completions are worth at most upper - D, where D = upper - value -
    lam·(cap - weight) is what its flips have cost, less next_cost if it is over budget.
    Returns the new states and, for each, (parent index, flipped)."""
    m = fw.size
    ow = np.empty(2 * m)
    ov = np.empty(2 * m)
    parent = np.empty(2 * m, dtype=np.int64)
    flip = np.empty(2 * m, dtype=np.bool_)
    a = 0
    b = 0
    k = 0
    top = -np.inf
    while a < m or b < m:
        if b >= m or (a < m and fw[a] <= fw[b] + dw):
            cw, cv, p, f = fw[a], fv[a], a, False
            a += 1
        else:
            cw, cv, p, f = fw[b] + dw, fv[b] + dv, b, True
            b += 1
        if cv <= top:  # heavier and not better: dominated
            continue
        top = cv
        bound = cv + lam * (cap - cw)  # = upper - D
        if cw > cap:
            bound -= next_cost
        if bound < best:
            continue
        ow[k], ov[k], parent[k], flip[k] = cw, cv, p, f
        k += 1
    return ow[:k], ov[:k], parent[:k], flip[:k]


def allocate(C, w, budget: float) -> Allocation:
    """The exact optimum of min Σ C f(b) s.t. Σ w b <= budget, b in 1..8."""
    C, w, budget = _validate(C, w, budget)
    n = C.size
    capacity = budget - w.sum()
    item, value, weight, eff = _raises(C, w)
    cum = np.cumsum(weight)
    fits = np.searchsorted(cum, capacity * (1 + 1e-15), side="right")
    if fits == item.size:  # everything fits: 8 bits everywhere
        bits = np.full(n, MAX_BITS)
        return Allocation(bits, variance(C, bits), budget, float(w @ bits), 0.0, 0)
    lam = eff[fits]
    before = cum[fits - 1] if fits else 0.0
    upper = value[:fits].sum() + value[fits] * (capacity - before) / weight[fits]
    # The LP side of every raise: the ones before the break are in, the rest out.
    lp_side = np.zeros(item.size, dtype=bool)
    lp_side[:fits] = True
    take = _greedy_fill(item, weight, capacity, n)
    best_value = value[take].sum()
    chosen = take
    # Expanding core: raises in order of |reduced cost|; flipping one costs at least that
    # much of the bound, so the search ends when the next one costs more than the gap.
    cost = np.abs(value - lam * weight)
    order = np.argsort(cost, kind="stable")
    margin = 1e-12 * upper  # rounding in the sums
    fw = np.array([weight[:fits].sum()])
    fv = np.array([value[:fits].sum()])
    parents, flips = [], []
    steps = 0
    for steps, k in enumerate(order, start=1):
        if cost[k] > upper - best_value + margin:
            steps -= 1
            break
        sign = -1.0 if lp_side[k] else 1.0
        next_cost = cost[order[steps]] if steps < order.size else 0.0
        fw, fv, parent, flip = _flip_step(fw, fv, sign * weight[k], sign * value[k], capacity,
                                          upper, lam, next_cost, best_value - margin)
        parents.append(parent)
        flips.append(flip)
        feasible = fw <= capacity
        if feasible.any() and fv[feasible].max() > best_value:
            best_value = fv[feasible].max()
            chosen = None  # the best is a core state now
    if chosen is None:
        state = int(np.argmax(np.where(fw <= capacity, fv, -np.inf)))
        chosen = lp_side.copy()
        for s in range(steps - 1, -1, -1):
            if flips[s][state]:
                k = order[s]
                chosen[k] = not chosen[k]
            state = int(parents[s][state])
    # Raises of one item share a weight and fall in value: take each item's first k.
    bits = 1 + np.bincount(item[chosen], minlength=n)
    return Allocation(bits, variance(C, bits), budget, float(w @ bits),
                      float(upper - best_value), steps)


def greedy_heap(C, w, budget: float) -> np.ndarray:
    """The published heap greedy: from 8 bits everywhere, lower the bit whose rise in variance
    per unit of weight is smallest, until Σ w b <= budget."""
    import heapq

    C, w, budget = _validate(C, w, budget)
    bits = np.full(C.size, MAX_BITS)
    used = float(w.sum() * MAX_BITS)
    heap = [(C[i] * (_F[MAX_BITS - 1] - _F[MAX_BITS - 2]) / w[i], -i) for i in range(C.size)]
    heap = [(-d, j) for d, j in heap]  # a max-heap of the (negative) changes
    heapq.heapify(heap)
    while used > budget and heap:
        _, j = heapq.heappop(heap)
        i = -j
        bits[i] -= 1
        used -= w[i]
        if bits[i] > 1:
            b = bits[i]
            heapq.heappush(heap, (-(C[i] * (_F[b - 1] - _F[b - 2]) / w[i]), j))
    return bits


STATS_FORMAT = "actdesign.stats/1"
BITS_FORMAT = "actdesign.bits/1"


def load_stats(path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(names, C, w) from a stats file: {"format": "actdesign.stats/1", "items": [{"name",
    "C", "w"}, ...]}, as calibration writes it."""
    import math

    from actdesign.files import read_json

    origin = str(path)
    data = read_json(path, "stats")
    if not (isinstance(data, dict) and data.get("format") == STATS_FORMAT
            and isinstance(data.get("items"), list) and data["items"]):
        raise ActdesignError(f"{origin}: must be {{\"format\": \"{STATS_FORMAT}\", "
                             "\"items\": [...]}} with at least one item")
    names, C, w = [], [], []
    for k, it in enumerate(data["items"]):
        ok = (isinstance(it, dict) and set(it) == {"name", "C", "w"}
              and isinstance(it["name"], str)
              and all(isinstance(it[f], int | float) and not isinstance(it[f], bool)
                      and math.isfinite(it[f]) for f in ("C", "w")))
        if not ok:
            raise ActdesignError(f"{origin}: items[{k}] must be {{\"name\": text, \"C\": number, "
                                 "\"w\": number}")
        names.append(it["name"])
        C.append(float(it["C"]))
        w.append(float(it["w"]))
    if len(set(names)) != len(names):
        raise ActdesignError(f"{origin}: item names must be unique")
    return names, np.array(C), np.array(w)


def save_stats(path, items) -> None:
    """Write (name, C, w) items as a stats file that `load_stats` and `allocate` read."""
    import json

    from actdesign.files import write_atomic

    write_atomic(path, json.dumps({"format": STATS_FORMAT, "items": [
        {"name": name, "C": float(c), "w": float(w)} for name, c, w in items]},
        indent=1, allow_nan=False) + "\n")


def save_bits(path, result: Allocation, bits: dict, **extra) -> None:
    """Write an allocation: budget, use and variance, any `extra` facts, and bits by name."""
    import json

    from actdesign.files import write_atomic

    write_atomic(path, json.dumps({
        "format": BITS_FORMAT, "budget": result.budget, "used": result.used,
        "variance": result.variance, **extra, "bits": bits}, indent=1, allow_nan=False) + "\n")


def load_bits(path) -> dict[str, int]:
    """{name: bits} from a bits file that `save_bits` wrote (per-layer bits only). A name
    listing several layers, comma-separated (layers sharing one tensor's codes), gives each
    of them the bits."""
    from actdesign.files import read_json

    origin = str(path)
    data = read_json(path, "bits")
    bits = data.get("bits") if isinstance(data, dict) else None
    if not (isinstance(data, dict) and data.get("format") == BITS_FORMAT
            and isinstance(bits, dict)):
        raise ActdesignError(f"{origin}: must be {{\"format\": \"{BITS_FORMAT}\", "
                             "\"bits\": {...}}")
    for name, b in bits.items():
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8:
            raise ActdesignError(f"{origin}: bits of {name!r} must be one integer in 1..8 "
                                 "(per-sample allocations apply to one batch only)")
    return {layer: b for name, b in bits.items() for layer in name.split(",")}
