"""The exact memory plan: one option per site and a recompute flag per block (and, where a
block offers it, an offload flag), least gradient error under an activation-memory budget and
a step-time limit.

The model. A site keeps `bytes` for the backward pass with its chosen option, adds `error` to
the gradient and `time` to the step. A block either keeps what it saves (its sites' bytes plus
`inner_bytes`) or is recomputed: it then keeps only `input_bytes`, its sites are `keep`
(options[0], error 0), and its backward holds `held_bytes` beyond the saved bytes while it
runs (what it re-materialises and its working memory), one block at a time. Without a
measured `held_bytes`, that is taken as transient + R_b, R_b = inner + Σ keep bytes of its
sites: everything re-materialised on top of the largest working memory of the step.

    saved = fixed + Σ_s bytes[s, c_s] + Σ_b (inner_b, or input_b - Σ_{s in b} keep_s if r_b)
    peak  = saved + transient + max_{b: r_b} R_b          (0 when nothing is recomputed)
          = max(saved + transient, saved + max_{b: r_b} held_b), R_b = max(0, held_b - transient)
    time  = base + Σ_s time[s, c_s] + Σ_{b: r_b} time_b
    error = Σ_s error[s, c_s]

A recomputed block with an `offload_time` may also be offloaded (o_b): its input waits in host
memory, so it leaves the saved bytes (- input_b), and costs offload_time_b more; while its
backward runs, its input is back on the card and the next one's is fetched ahead, so its R_b
grows by input_b + the largest input of an offloadable block (I):

    saved -= Σ_{b: o_b} input_b,   R_b += (input_b + I) if o_b,   time += Σ_{b: o_b} offload_b

`solve` minimises error subject to peak <= budget and time <= max_time; among plans of equal
error the least time, then the least peak. Equal means within ERROR_TIE (TIME_TIE) of the
error (time) scale: the largest option error (the largest time, the base step's included),
rounded up to a power of two.

The MILP. Binary x[s, k] (Σ_k x[s, k] = 1 per site), binary r_b, and a continuous m for the
largest re-materialisation: m >= R_b r_b, and x[s, keep] >= r_b for the sites of block b.
Memory and time are then linear. The three objectives are three solves: least error; least
time with the error held at the optimum (plus the tie); least peak with the time held too.
Each later stage gets the plan before it as a bound on its objective (HiGHS's
objective_bound), so that it only searches for better ones.
An option that another matches or beats in bytes, error and time is dropped first (keep
stays: recomputation needs it); no optimum changes. Every row is divided by a power of two
(exact) so that its coefficients are of order one: HiGHS mis-proves optima when costs and
coefficients reach 1e9.

Exactness. HiGHS proves each stage optimal at zero relative and absolute gap, with a
feasibility tolerance of 1e-9 of the row's unit; the byte unit is at most 2**28 bytes, so
that tolerance stays below a third of a byte and bytes are resolved to 1 byte (byte totals
must stay below 2**53, checked, for the float64 coefficients to be exact integers). Errors
and times are optimal to 1e-9 of their scales. Each answer is rounded to 0/1 and priced
again by `evaluate` (integers for bytes, correctly rounded sums for times and errors); should
a limit still be broken, that limit is tightened by the excess (at least a byte) and the
stage solved again, so no plan returned breaks one.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from actdesign.errors import ActdesignError

ERROR_TIE = 1e-9  # errors this close, relative to the error scale, count as equal
TIME_TIE = 1e-9  # times this close, relative to the time scale, count as equal
MAX_TIGHTEN = 20  # re-solves allowed per stage after a violation slipped through
# Passed to HiGHS verbatim (scipy names them in a warning); the gaps make optimality proven.
# Presolve off: its restarts made these problems slower, some two-fold, in our measurements.
_HIGHS = {"mip_rel_gap": 0.0, "mip_abs_gap": 0.0, "mip_feasibility_tolerance": 1e-9,
          "presolve": False}
BYTE_UNIT = 2.0**28  # the largest byte unit: HiGHS's tolerance, 1e-9 of it, stays < 1/3 byte


def _count(value, what):
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ActdesignError(f"{what} must be an integer number of bytes >= 0, got {value!r}")
    return int(value)


def _amount(value, what):
    if isinstance(value, bool) or not isinstance(value, Real) or not (0 <= value < math.inf):
        raise ActdesignError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Option:
    name: str
    bytes: int  # kept for the backward pass
    error: float  # gradient error added
    time: float  # step time added, seconds

    def __post_init__(self):
        what = f"option {self.name!r}"
        object.__setattr__(self, "bytes", _count(self.bytes, f"{what}: bytes"))
        object.__setattr__(self, "error", _amount(self.error, f"{what}: error"))
        object.__setattr__(self, "time", _amount(self.time, f"{what}: time"))


@dataclass(frozen=True)
class Site:
    name: str
    options: tuple[Option, ...]  # options[0] is keep, the lossless base
    block: int | None  # the block it lies in, or None

    def __post_init__(self):
        options = tuple(self.options)
        if not options or not all(isinstance(o, Option) for o in options):
            raise ActdesignError(f"site {self.name!r} needs at least one Option (keep first)")
        object.__setattr__(self, "options", options)


@dataclass(frozen=True)
class Block:
    name: str
    input_bytes: int  # what it keeps when recomputed
    inner_bytes: int  # saved by it, counted by none of its sites
    time: float  # its recomputation (a forward)
    held_bytes: int | None = None  # held beyond the saved bytes while its backward runs
    offload_time: float | None = None  # its input's copies to the host and back; None: not
    # offered

    def __post_init__(self):
        what = f"block {self.name!r}"
        object.__setattr__(self, "input_bytes", _count(self.input_bytes, f"{what}: input_bytes"))
        object.__setattr__(self, "inner_bytes", _count(self.inner_bytes, f"{what}: inner_bytes"))
        object.__setattr__(self, "time", _amount(self.time, f"{what}: time"))
        if self.held_bytes is not None:
            object.__setattr__(self, "held_bytes", _count(self.held_bytes, f"{what}: held_bytes"))
        if self.offload_time is not None:
            object.__setattr__(self, "offload_time",
                               _amount(self.offload_time, f"{what}: offload_time"))


@dataclass(frozen=True)
class Problem:
    sites: tuple[Site, ...]
    blocks: tuple[Block, ...]
    fixed_bytes: int  # saved whatever the plan
    transient_bytes: int  # working memory on top of what is saved
    base_time: float  # the step without any option or recomputation

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(self.sites))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "fixed_bytes", _count(self.fixed_bytes, "fixed_bytes"))
        object.__setattr__(self, "transient_bytes",
                           _count(self.transient_bytes, "transient_bytes"))
        object.__setattr__(self, "base_time", _amount(self.base_time, "base_time"))
        if not all(isinstance(b, Block) for b in self.blocks):
            raise ActdesignError("every block must be a Block")
        for site in self.sites:
            if not isinstance(site, Site):
                raise ActdesignError("every site must be a Site")
            if site.block is not None and (
                    isinstance(site.block, bool) or not isinstance(site.block, Integral)
                    or not 0 <= site.block < len(self.blocks)):
                raise ActdesignError(f"site {site.name!r}: block {site.block!r} is not an index "
                                     f"of the {len(self.blocks)} blocks")
        if _byte_bound(self) >= 2**53:
            raise ActdesignError("the byte totals reach 2**53: too large to plan to the byte")


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # option index per site
    recomputed: tuple[bool, ...]  # per block
    saved: int
    peak: int
    time: float
    error: float
    offloaded: tuple[bool, ...]  # per block: its input in host memory (recomputed too)


def _byte_bound(problem):
    """At least the magnitude of every byte total a plan can have."""
    return (problem.fixed_bytes + problem.transient_bytes
            + sum(max(o.bytes for o in s.options) for s in problem.sites)
            + 2 * sum(s.options[0].bytes for s in problem.sites)
            + 2 * sum(b.inner_bytes + b.input_bytes + (b.held_bytes or 0)
                      for b in problem.blocks)
            + sum(_offload_bytes(problem)))


def _remat(problem):
    """R_b: what recomputing block b adds to the peak over the transient, and Σ keep bytes of
    its sites."""
    keep = [0] * len(problem.blocks)
    for site in problem.sites:
        if site.block is not None:
            keep[site.block] += site.options[0].bytes
    return [b.inner_bytes + k if b.held_bytes is None
            else max(0, b.held_bytes - problem.transient_bytes)
            for b, k in zip(problem.blocks, keep, strict=True)], keep


def _offload_bytes(problem):
    """Per block, what offloading it adds to R_b: its input back on the card, and the next
    block's fetched ahead (at most the largest input of a block that can be offloaded)."""
    ahead = max((b.input_bytes for b in problem.blocks if b.offload_time is not None),
                default=0)
    return [b.input_bytes + ahead if b.offload_time is not None else 0
            for b in problem.blocks]


def evaluate(problem: Problem, choice, recomputed, offloaded=None) -> Solution:
    """Price a plan by the model above, exactly: bytes as integers, times and errors as
    correctly rounded sums. A site of a recomputed block must choose keep (0); an offloaded
    block must be recomputed and offer offloading."""
    choice, recomputed = tuple(int(c) for c in choice), tuple(bool(r) for r in recomputed)
    offloaded = (False,) * len(recomputed) if offloaded is None else \
        tuple(bool(o) for o in offloaded)
    if len(choice) != len(problem.sites) or len(recomputed) != len(problem.blocks) \
            or len(offloaded) != len(problem.blocks):
        raise ActdesignError(f"a plan needs {len(problem.sites)} choices and "
                             f"{len(problem.blocks)} recompute and offload flags, got "
                             f"{len(choice)}, {len(recomputed)} and {len(offloaded)}")
    for block, r, o in zip(problem.blocks, recomputed, offloaded, strict=True):
        if o and not r:
            raise ActdesignError(f"block {block.name!r} is offloaded but not recomputed")
        if o and block.offload_time is None:
            raise ActdesignError(f"block {block.name!r} does not offer offloading")
    remat, keep = _remat(problem)
    saved, times, errors = problem.fixed_bytes, [problem.base_time], []
    for site, c in zip(problem.sites, choice, strict=True):
        if not 0 <= c < len(site.options):
            raise ActdesignError(f"site {site.name!r} has no option {c}")
        if c and site.block is not None and recomputed[site.block]:
            raise ActdesignError(f"site {site.name!r} lies in a recomputed block: it keeps")
        option = site.options[c]
        saved += option.bytes
        times.append(option.time)
        errors.append(option.error)
    most, extra = 0, _offload_bytes(problem)
    for b, block in enumerate(problem.blocks):
        if offloaded[b]:
            saved -= keep[b]
            times += [block.time, block.offload_time]
            most = max(most, remat[b] + extra[b])
        elif recomputed[b]:
            saved += block.input_bytes - keep[b]
            times.append(block.time)
            most = max(most, remat[b])
        else:
            saved += block.inner_bytes
    return Solution(choice, recomputed, saved, saved + problem.transient_bytes + most,
                    math.fsum(times), math.fsum(errors), offloaded)


def _power_of_two(x):
    """The least power of two >= x, for x > 0 (1 otherwise): dividing by it is exact."""
    return 2.0 ** math.ceil(math.log2(x)) if x > 0 else 1.0


class _Milp:
    """The formulation. Columns: x (the options left after dominance), r per block, o per block
    that can be offloaded, then m (in byte units) when there are blocks. Rows: one option
    per site; keep when recomputed; o_b <= r_b; m >= R_b r_b + (input_b + I) o_b; then the
    limits. Every row is in units of a power of two, so that its coefficients are of order
    one (HiGHS is unreliable with 1e9-sized ones) and exact."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.site_of, self.option_of = [], []
        for s, site in enumerate(problem.sites):
            for k in _undominated(site.options):
                self.site_of.append(s)
                self.option_of.append(k)
        options = [problem.sites[s].options[k]
                   for s, k in zip(self.site_of, self.option_of, strict=True)]
        blocks, remat, keep = problem.blocks, *_remat(problem)
        self.nx, self.nb, tail = len(options), len(blocks), [1] if blocks else []
        self.offloadable = [b for b, block in enumerate(blocks) if block.offload_time is not None]
        self.nf, extra = len(self.offloadable), _offload_bytes(problem)
        self.n = self.nx + self.nb + self.nf + len(tail)
        peak = [o.bytes for o in options] + [
            b.input_bytes - k - b.inner_bytes for b, k in zip(blocks, keep, strict=True)] + [
            -blocks[b].input_bytes for b in self.offloadable]
        reach = [r + e for r, e in zip(remat, extra, strict=True)]  # m's largest, offloaded
        self.unit = min(_power_of_two(max(map(abs, peak + reach), default=0)), BYTE_UNIT)
        # Per column, in units: peak minus peak_constant, time minus base, error.
        self.peak = np.append(np.array(peak, dtype=float) / self.unit, tail)  # m: in units
        self.peak_constant = (problem.fixed_bytes + problem.transient_bytes
                              + sum(b.inner_bytes for b in blocks))
        time = [o.time for o in options] + [b.time for b in blocks] + [
            blocks[b].offload_time for b in self.offloadable] + [0] * len(tail)
        self.seconds = _power_of_two(max(time + [problem.base_time]))
        self.time = np.array(time) / self.seconds
        error = [o.error for o in options] + [0] * (self.nb + self.nf + len(tail))
        self.errors = _power_of_two(max(error, default=0))
        self.error = np.array(error) / self.errors
        flags = self.nx + self.nb + self.nf
        self.upper = np.array([1] * flags + [max(reach, default=0) / self.unit] * len(tail),
                              dtype=float)
        self.binary = np.array([1] * flags + [0] * len(tail))  # m: continuous
        self.structure = self._structure(remat, extra)

    def _structure(self, remat, extra):
        entries, lower, upper = [], [], []

        def row(terms, lo, hi):
            entries.extend((len(lower), col, value) for col, value in terms)
            lower.append(lo)
            upper.append(hi)

        sites, m = self.problem.sites, self.nx + self.nb + self.nf
        offload_column = {b: self.nx + self.nb + i for i, b in enumerate(self.offloadable)}
        columns = [[] for _ in sites]
        for j, s in enumerate(self.site_of):
            columns[s].append(j)
        for s, site in enumerate(sites):
            row([(j, 1.0) for j in columns[s]], 1.0, 1.0)
            if site.block is not None:  # columns[s][0] is keep
                row([(columns[s][0], 1.0), (self.nx + site.block, -1.0)], 0.0, np.inf)
        for b, r in enumerate(remat):
            terms = [(m, 1.0), (self.nx + b, -r / self.unit)]
            if b in offload_column:
                row([(self.nx + b, 1.0), (offload_column[b], -1.0)], 0.0, np.inf)
                terms.append((offload_column[b], -extra[b] / self.unit))
            row(terms, 0.0, np.inf)
        if not lower:
            return None
        r, c, v = np.array(entries).T
        matrix = coo_array((v, (r.astype(int), c.astype(int))), shape=(len(lower), self.n))
        return LinearConstraint(matrix.tocsr(), lower, upper)

    def run(self, objective, budget, max_time, error_cap=None, integral=True, bound=None):
        """Minimise `objective` (one of the rows) under the limits: the columns' values, or
        None if infeasible."""
        rows = [LinearConstraint(self.peak, -np.inf, (budget - self.peak_constant) / self.unit)]
        if max_time < math.inf:
            rows.append(LinearConstraint(self.time, -np.inf,
                                         (max_time - self.problem.base_time) / self.seconds))
        if error_cap is not None:
            rows.append(LinearConstraint(self.error, -np.inf, error_cap / self.errors))
        if self.structure is not None:
            rows.append(self.structure)
        if self.n == 0:
            feasible = all(np.all(c.lb <= 0) and np.all(0 <= c.ub) for c in rows)
            return np.zeros(0) if feasible else None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
            options = dict(_HIGHS) if bound is None else dict(_HIGHS, objective_bound=bound)
            result = milp(objective, integrality=self.binary * integral,
                          bounds=Bounds(0, self.upper), constraints=rows, options=options)
        if result.status == 2:
            return None
        if result.status != 0:
            raise RuntimeError(f"HiGHS did not finish the plan: {result.message}")
        return result.x

    def plan(self, x) -> Solution:
        choice = [0] * len(self.problem.sites)
        best = [-1.0] * len(self.problem.sites)
        for j in range(self.nx):
            s = self.site_of[j]
            if x[j] > best[s]:
                best[s], choice[s] = x[j], self.option_of[j]
        recomputed = x[self.nx:self.nx + self.nb] > 0.5
        offloaded = [False] * self.nb
        for i, b in enumerate(self.offloadable):
            offloaded[b] = x[self.nx + self.nb + i] > 0.5
        return evaluate(self.problem, choice, recomputed, offloaded)


def _undominated(options):
    """Indices of the options no other option matches or beats in bytes, error and time
    (ties: the first stays); keep (0) always stays."""
    key = [(o.bytes, o.error, o.time) for o in options]
    return [k for k in range(len(options)) if k == 0 or not any(
        all(a <= b for a, b in zip(key[i], key[k], strict=True)) and (key[i] != key[k] or i < k)
        for i in range(len(options)) if i != k)]


def _stage(form, objective, budget, max_time, error_cap=None, bound=None) -> Solution | None:
    """The optimum of one objective under exact limits: re-solved with a tighter limit each
    time the rounded answer breaks one."""
    rhs = [budget, max_time, error_cap]
    for _ in range(MAX_TIGHTEN):
        x = form.run(objective, *rhs, bound=bound)
        if x is None:
            return None
        plan = form.plan(x)
        excess = [plan.peak - budget, plan.time - max_time,
                  plan.error - error_cap if error_cap is not None else 0]
        if all(e <= 0 for e in excess):
            return plan
        units = [1, form.seconds * 1e-15, form.errors * 1e-15]
        rhs = [r - max(e, u) if e > 0 else r for r, e, u in zip(rhs, excess, units,
                                                                  strict=True)]
    raise RuntimeError("HiGHS kept returning plans beyond the limits")


def _budget(problem, budget) -> int:
    """A budget in whole bytes; above every possible peak, that peak's bound."""
    if isinstance(budget, bool) or not isinstance(budget, Real) or not budget > -math.inf:
        raise ActdesignError(f"the budget must be a number of bytes, got {budget!r}")
    return math.floor(min(budget, _byte_bound(problem)))


def _time_limit(problem, max_time) -> float:
    """The time limit as a float; an error when even the fastest plan (every site its quickest
    option, nothing recomputed) is over it."""
    if isinstance(max_time, bool) or not isinstance(max_time, Real) or not max_time > 0:
        raise ActdesignError(f"the time limit must be a number > 0 seconds, got {max_time!r}")
    choice = [min(range(len(s.options)), key=lambda k, s=s: s.options[k].time)
              for s in problem.sites]
    fastest = evaluate(problem, choice, [False] * len(problem.blocks)).time
    if fastest > max_time:
        raise ActdesignError(f"the time limit {_seconds(problem, max_time)} cannot be met: the "
                             f"fastest plan takes {_seconds(problem, fastest)}")
    return float(max_time)


def _seconds(problem, t):
    ratio = f" ({t / problem.base_time:.3f}x the base step)" if problem.base_time > 0 else ""
    return f"{t:g} s{ratio}"


def _within(problem, max_time):
    if max_time == math.inf:
        return "without a time limit"
    if problem.base_time > 0:
        return f"within {max_time / problem.base_time:.2f}x time"
    return f"within {max_time:g} s"


def _mib(n):
    return f"{n / 2**20:,.1f} MiB ({n:,} bytes)"


def solve(problem: Problem, budget: int, max_time: float) -> Solution:
    """The least-error plan with peak <= budget bytes and time <= max_time seconds (ties: the
    least time, then the least peak). An ActdesignError naming the smallest feasible budget
    when there is none."""
    budget, max_time = _budget(problem, budget), _time_limit(problem, max_time)
    return _solve(_Milp(problem), budget, max_time)


def _solve(form, budget, max_time, known=None):
    """Three stages; each starts from the plan before it as a bound on its objective (a stage
    that finds nothing better keeps that plan). `known`: a plan within the limits, if any."""
    bound = None if known is None else known.error / form.errors
    best = _stage(form, form.error, budget, max_time, bound=bound) or known
    if best is None:
        least = _least_peak(form, max_time)
        if least.peak <= budget:
            raise RuntimeError(f"HiGHS found no plan within {budget} bytes but one of "
                               f"{least.peak}")
        raise ActdesignError(f"the budget {_mib(budget)} cannot be met: the smallest feasible "
                             f"is {_mib(least.peak)} {_within(form.problem, max_time)}")
    cap = best.error + ERROR_TIE * form.errors
    quick = _stage(form, form.time, budget, max_time, cap,
                   bound=(best.time - form.problem.base_time) / form.seconds) or best
    within = min(max_time, quick.time + TIME_TIE * form.seconds)
    return _stage(form, form.peak, budget, within, cap,
                  bound=(quick.peak - form.peak_constant) / form.unit) or quick


def _least_peak(form, max_time) -> Solution:
    plan = _stage(form, form.peak, _byte_bound(form.problem), max_time)
    if plan is None:
        raise RuntimeError("HiGHS found no plan within the time limit, the fastest one included")
    return plan


def smallest_peak(problem: Problem, max_time: float) -> Solution:
    """The plan of least peak within the time limit (ties: the least error, then time)."""
    form = _Milp(problem)
    max_time = _time_limit(problem, max_time)
    least = _least_peak(form, max_time)
    return _solve(form, least.peak, max_time, known=least)


def front(problem: Problem, budgets, max_time: float) -> list[Solution]:
    """`solve` at each budget, skipping the budgets no plan meets. Solved from the smallest
    up, each plan bounding the next's error."""
    form = _Milp(problem)
    max_time = _time_limit(problem, max_time)
    known = _least_peak(form, max_time)
    plans = {}
    for budget in sorted({_budget(problem, b) for b in budgets}):
        if budget >= known.peak:
            plans[budget] = known = _solve(form, budget, max_time, known)
    return [plans[b] for b in (_budget(problem, b) for b in budgets) if b in plans]


def relaxed_error(problem: Problem, budget: int, max_time: float) -> float:
    """The LP relaxation's least error: a lower bound on the error of every plan within the
    limits."""
    budget, max_time = _budget(problem, budget), _time_limit(problem, max_time)
    form = _Milp(problem)
    x = form.run(form.error, budget, max_time, integral=False)
    if x is None:
        raise ActdesignError("no fractional plan meets these limits either")
    return float(form.error @ x) * form.errors
