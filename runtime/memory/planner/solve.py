"""The solver's plan made exact: each plan checked by a shape-only step of its policy,
planned again where its peak is over, and the smallest budget met named exactly when none
fits."""

from __future__ import annotations

import time
from dataclasses import replace

from actdesign.designer import plan as solver
from actdesign.errors import ActdesignError

from .costs import Costs, ShapeSteps
from .report import MemoryPlan
from .sites import plan_policy


class Clock:
    def __init__(self, progress):
        self.progress, self.start, self.marks = progress, time.perf_counter(), {}

    def say(self, message):
        if self.progress is not None:
            self.progress(f"[{time.perf_counter() - self.start:6.1f} s] {message}")

    def lap(self, name):
        now = time.perf_counter()
        self.marks[name] = round(now - self.start - sum(self.marks.values()), 3)


def solve_verified(model, example, costs: Costs, budget: int, max_slowdown, precision,
                   kernels, clock, attempts: int = 6) -> MemoryPlan:
    """The solver's plan, checked by a shape-only step of the policy it gives; over the
    budget, planned again under a budget lowered by the excess. Where that leaves no plan,
    the least-error plan among `candidates` whose exact peak fits. Else the budget is
    refused, naming the smallest budget this function meets: a plan peaks at it exactly,
    and one byte less is refused."""
    problem = costs.problem
    max_time = max_slowdown * problem.base_time
    verify = _Verify(model, example, costs, precision, kernels, max_slowdown, clock)
    result = _attempts(verify, problem, budget, max_time, attempts, clock)
    found = None
    if result is None:
        found = candidates(verify, problem, max_time, attempts, clock)
        fits = [c for c in found if c.peak_bytes <= budget]
        if fits:
            result = min(fits, key=lambda c: (c.solution.error, c.solution.time, c.peak_bytes))
    if result is not None:
        clock.lap("solve")
        return replace(result, budget=budget)
    least = min(found, key=lambda c: c.peak_bytes)
    modelled = solver.smallest_peak(problem, max_time).peak
    raise ActdesignError(
        f"the budget {budget:,} bytes cannot be met within {max_slowdown:.2f}x time: the "
        f"smallest budget plan meets is {least.peak_bytes / 2**20:,.2f} MiB "
        f"({least.peak_bytes:,} bytes; a plan peaks there exactly, one byte less is "
        f"refused). The search is approximate: the least of {len(found)} plans checked from "
        f"the least modelled peak ({modelled:,} bytes) up, so a plan outside them might peak "
        "lower")


class _Verify:
    """Plans priced exactly by a shape-only step of the policy each gives, each once."""

    def __init__(self, model, example, costs, precision, kernels, max_slowdown, clock):
        self.shapes = ShapeSteps(model, example, precision, kernels)
        self.costs, self.max_slowdown, self.clock = costs, max_slowdown, clock
        self.memo = {}

    def __call__(self, solution) -> MemoryPlan:
        key = (solution.choice, solution.recomputed, solution.offloaded)
        if key not in self.memo:
            policy = plan_policy(self.costs, solution)
            step = self.shapes.run(policy)
            self.memo[key] = policy, step.saved.total, step.peak
        policy, saved, peak = self.memo[key]
        return MemoryPlan(policy, self.costs, solution, saved, peak, peak, self.max_slowdown,
                          self.clock.marks)


def _attempts(verify, problem, budget, max_time, attempts, clock) -> MemoryPlan | None:
    """The solver's plan under `budget`, planned again under a budget lowered by the excess
    while its exact peak is over: a plan within `budget`, or None."""
    target = budget
    for _ in range(attempts):
        try:
            result = verify(solver.solve(problem, target, max_time))
        except ActdesignError:  # none under the lowered (or modelled) budget
            return None
        if result.peak_bytes <= budget:
            return result
        target -= result.peak_bytes - budget
        clock.say(f"the planned peak {result.peak_bytes:,} is over the budget: planning again")
    return None


def candidates(verify, problem, max_time, attempts, clock, steps: int = 8) -> list:
    """The plans near the least modelled peak, verified: the least-peak plan, the front at
    `steps` budgets from its modelled peak to its exact one, then the solver's plan under
    one byte less than the least exact peak found, again while one is found. Deterministic
    for a problem, so the smallest of them is a budget `solve_verified` meets, and one byte
    less is one it refuses."""
    least = verify(solver.smallest_peak(problem, max_time))
    found = {least.solution: least}
    low, high = least.solution.peak, least.peak_bytes
    if high > low:
        for s in solver.front(problem, [low + (high - low) * k // (steps - 1)
                                        for k in range(steps)], max_time):
            found.setdefault(s, verify(s))
    while True:
        lowest = min(found.values(), key=lambda c: c.peak_bytes)
        below = _attempts(verify, problem, lowest.peak_bytes - 1, max_time, attempts, clock)
        if below is None:
            return list(found.values())
        found[below.solution] = below


def smallest_budget(model, example, costs: Costs, max_slowdown, precision, kernels) -> int:
    """The smallest budget `solve_verified` meets: the least exact peak of its candidates."""
    problem = costs.problem
    verify = _Verify(model, example, costs, precision, kernels, max_slowdown, Clock(None))
    found = candidates(verify, problem, max_slowdown * problem.base_time, 6, Clock(None))
    return min(c.peak_bytes for c in found)
