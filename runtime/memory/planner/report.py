"""A plan as the user reads it: its lossy sites and recomputed blocks in MiB, error and ms,
its JSON report, and the error-memory front with the presets on it."""

from __future__ import annotations

from dataclasses import dataclass, field

from actdesign.designer import plan as solver

from ...apply import policy as policy_mod
from . import explain as explain_mod
from .costs import Costs, ShapeSteps
from .sites import PRESETS, preset_policy


@dataclass
class MemoryPlan:
    policy: policy_mod.Policy
    costs: Costs
    solution: solver.Solution
    saved_bytes: int  # the planned step's, exact
    peak_bytes: int
    budget: int
    max_slowdown: float
    timings: dict = field(default_factory=dict)
    explanation: explain_mod.Explanation | None = None  # presets, the lossless hint, noise

    def rows(self) -> list[tuple[str, str, int, float, float]]:
        """(site or block, choice, bytes saved against keeping it whole, error, time) for
        every site a lossy option took and every block recomputed."""
        p, out = self.costs.problem, []
        for site, s, c in zip(self.costs.sites, p.sites, self.solution.choice, strict=True):
            if c:
                o = s.options[c]
                out.append((site.name, o.name, s.options[0].bytes - o.bytes, o.error, o.time))
        for name, b, on, host in zip(self.costs.blocks, p.blocks, self.solution.recomputed,
                                     self.solution.offloaded, strict=True):
            if host:
                out.append((name, "offload", b.inner_bytes, 0.0, b.time + b.offload_time))
            elif on:
                out.append((name, "checkpoint", b.inner_bytes - b.input_bytes, 0.0, b.time))
        return out

    def report(self) -> dict:
        return {"format": "actdesign.plan-report",
                "budget_bytes": self.budget, "max_slowdown": self.max_slowdown,
                "predicted_saved_bytes": self.saved_bytes,
                "predicted_peak_bytes": self.peak_bytes,
                "predicted_error": self.solution.error,
                "predicted_time_s": self.solution.time,
                "base_time_s": self.costs.problem.base_time,
                "baseline_saved_bytes": self.costs.baseline_saved,
                "baseline_peak_bytes": self.costs.baseline_peak,
                "time_model": self.costs.card.describe(),
                "calibration": self.costs.calibration,
                "calibration_passes_per_batch": self.costs.passes,
                "seconds": self.timings,
                "sites": [{"site": s, "choice": c, "saved_bytes": b, "error": e, "time_s": t}
                          for s, c, b, e, t in self.rows()],
                "explanation": None if self.explanation is None else
                self.explanation.to_dict(self.solution.error),
                "policy": self.policy.to_dict()}

    def _measured(self) -> str:
        e = self.explanation
        if e is None or e.chosen is not None:
            return ""  # a chosen preset's error is its measured one
        return f" (modelled; measured {e.measured_error:.3g})"

    def table(self) -> str:
        base = self.costs.problem.base_time
        lines = [f"{'site (lossy choices and recomputed blocks)':<48}{'choice':>12}"
                 f"{'saved MiB':>11}{'error':>11}{'time ms':>10}{'of step':>9}"]
        for site, choice, n, e, t in self.rows():
            lines.append(f"{_tail(site, 47):<48}{choice:>12}{n / 2**20:>11.3f}{e:>11.3g}"
                         f"{t * 1e3:>10.3g}{t / base:>9.2%}")
        if not self.rows():
            lines.append(f"(none: every site keeps its input, {self.costs.base} applies)")
        lines.append(f"planned on {self.costs.base}: peak {self.peak_bytes / 2**20:,.2f} MiB "
                     f"({self.peak_bytes:,} bytes; budget {self.budget:,}), saved "
                     f"{self.saved_bytes / 2**20:,.2f} MiB (uncompressed "
                     f"{self.costs.baseline_saved / 2**20:,.2f}), gradient error "
                     f"{self.solution.error:.3g}{self._measured()}, time "
                     f"{self.solution.time / base:.3f}x "
                     f"of a {base * 1e3:.3g} ms step ({self.costs.card.describe()})")
        lines.append(f"errors measured on {self.costs.calibration}")
        if self.explanation is not None:
            lines += explain_mod.lines(self, self.explanation)
        return "\n".join(lines)


def _tail(name: str, width: int) -> str:
    """A name in `width` characters, keeping its informative end."""
    return name if len(name) <= width else "…" + name[-(width - 1):]


@dataclass
class Point:
    label: str
    saved: int
    peak: int
    error: float  # measured


def measure_policy(plan: MemoryPlan, model, example, precision, policy, label,
                   kernels="cuda") -> Point:
    """A policy's exact saved bytes and peak at the plan's shape and its measured error."""
    step = ShapeSteps(model, example, precision, kernels).run(policy)
    return Point(label, step.saved.total, step.peak, plan.costs.reference.error(policy))


def front(plan: MemoryPlan, count: int = 20) -> list:
    """The modelled least error at `count` budgets from the smallest feasible peak to the
    uncompressed model's."""
    p = plan.costs.problem
    max_time = plan.max_slowdown * p.base_time
    low = solver.smallest_peak(p, max_time).peak
    high = max(plan.costs.baseline_peak, low)
    budgets = [int(low + (high - low) * i / (count - 1)) for i in range(count)]
    return solver.front(p, budgets, max_time)


def draw_front(plan: MemoryPlan, model, batches, example, precision, path,
               progress=None, kernels="cuda") -> None:
    """The error-memory front (modelled), the presets at their exact peaks and measured
    errors (hollow, and named so, where over the budget or the time limit), and the plan at
    its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from actdesign.files import check_writable
    from actdesign.report import save_figure

    check_writable(path)
    shapes = ShapeSteps(model, example, precision, kernels)
    explanation = plan.explanation
    if explanation is None:
        if progress is not None:
            progress("pricing the presets for the plot")
        explanation = explain_mod.explain(
            plan, shapes, [(n, preset_policy(plan.costs, n)) for n in PRESETS[plan.costs.base]])
    planned = Point("plan", plan.saved_bytes, plan.peak_bytes,
                    plan.costs.reference.error(plan.policy))
    curve = front(plan)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.step([s.peak / 2**20 for s in curve], [max(s.error, 1e-12) for s in curve],
            where="post", label="plan front (modelled)")
    for row in explanation.presets:  # hollow: over the budget or the time limit
        broken = [m for m, on in (("over budget", row.over_budget),
                                  ("over time", row.over_time)) if on]
        xy = (row.peak / 2**20, max(row.error, 1e-12))
        ax.plot(*xy, "o", color="tab:gray", fillstyle="none" if broken else "full")
        ax.annotate(row.label + (f" ({', '.join(broken)})" if broken else ""), xy,
                    fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.plot(planned.peak / 2**20, max(planned.error, 1e-12), "*", color="tab:red",
            markersize=12, label="this plan (measured)")
    ax.axvline(plan.budget / 2**20, color="tab:red", linestyle=":", label="budget")
    ax.set_yscale("log")
    ax.set_xlabel("activation peak (MiB)")
    ax.set_ylabel("gradient error E|g^ - g|^2 / E|g|^2")
    ax.legend(fontsize=8)
    save_figure(fig, path)
