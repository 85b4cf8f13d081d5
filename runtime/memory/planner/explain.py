"""What a plan's numbers mean to the user who chooses between it and the alternatives:

- every preset beside it, with its exact peak, its measured gradient error and its modelled
  time, marked where it is over the budget or over the time limit;
- the lossless plan (MS ops, some blocks recomputed, no lossy site) that fits the budget at
  the least slowdown, where the plan lost accuracy for time: say at what slowdown it would
  have been chosen;
- the plan's gradient error beside the stochastic gradient's own noise, measured on the
  calibration batches: ν = n/(n−1) Σ_b ‖g_b − ḡ‖² / Σ_b ‖g_b‖² over n batches (ḡ their mean;
  the error ε is normalised by the same Σ_b ‖g_b‖²). The noise of a batch of B sequences
  falls as 1/B, so at the training batch B it is ν_B = ν·b/B (b: the calibration batch).
  An error ε that does not fall with the batch (the conservative case: a table's bias) adds
  to it as the noise of a smaller batch would: ν_B + ε = ν·b/B', B' = B·ν_B/(ν_B + ε).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from actdesign.designer import plan as solver

from ...methods import METHODS
from ...methods.checkpoint import Checkpoint
from .sites import plan_policy


@dataclass
class PresetRow:
    label: str
    peak: int  # exact, at the plan's shape
    error: float  # measured on the calibration batches
    slowdown: float  # modelled, against the lossless step
    over_budget: bool
    over_time: bool

    def to_dict(self) -> dict:
        return {"preset": self.label, "peak_bytes": self.peak, "error": self.error,
                "slowdown": self.slowdown, "over_budget": self.over_budget,
                "over_time_limit": self.over_time}


@dataclass
class Lossless:
    slowdown: float  # modelled
    peak: int  # exact
    blocks: int  # recomputed


@dataclass
class Explanation:
    presets: list[PresetRow]
    lossless: Lossless | None  # a lossless plan the time limit kept out, if any fits
    noise: float | None  # ν on the calibration batches (None with one batch)
    calibration_batch: int | None
    training_batch: int | None
    batches: int
    measured_error: float  # the solver's plan's error, measured as the presets' are
    chosen: str | None = None  # the preset taken in its place, where one measured better

    def equivalent_batch(self, error: float) -> float | None:
        """B': the batch whose own noise equals the training batch's plus `error`."""
        if not (self.noise and self.calibration_batch and self.training_batch) or error <= 0:
            return None
        at_b = self.noise * self.calibration_batch / self.training_batch
        return self.training_batch * at_b / (at_b + error)

    def to_dict(self, error: float) -> dict:
        return {"presets": [p.to_dict() for p in self.presets],
                "lossless_alternative": None if self.lossless is None else {
                    "slowdown": self.lossless.slowdown, "peak_bytes": self.lossless.peak,
                    "recomputed_blocks": self.lossless.blocks},
                "gradient_noise": self.noise, "calibration_batch": self.calibration_batch,
                "training_batch": self.training_batch,
                "equivalent_batch": self.equivalent_batch(error),
                "solver_plan_measured_error": self.measured_error,
                "chosen_preset": self.chosen}


def explain(plan, shapes, presets) -> Explanation:
    """The explanation of `plan` (a planner.MemoryPlan): `shapes` prices a policy's exact
    peak (planner.ShapeSteps at the plan's shape), `presets` is [(label, policy)]."""
    costs = plan.costs
    p = costs.problem
    max_time = plan.max_slowdown * p.base_time
    rows = []
    for label, policy in presets:
        peak = shapes.run(policy).peak
        slowdown = preset_solution(costs, policy).time / p.base_time
        rows.append(PresetRow(label, peak, costs.reference.error(policy), slowdown,
                              peak > plan.budget, slowdown * p.base_time > max_time * (1 + 1e-9)))
    lossless = None
    if plan.solution.error > 0:
        lossless = lossless_alternative(plan, shapes)
    reference = costs.reference
    return Explanation(rows, lossless, reference.noise, batch_size(reference.batches[0]),
                       batch_size(shapes.example), len(reference.batches),
                       reference.error(plan.policy))


def better_preset(explanation: Explanation) -> PresetRow | None:
    """The preset of least measured error within the budget and the time limit, where its
    error is below the solver's plan's, measured the same way (the solver adds its sites'
    errors, measured class by class, and that sum can miss how they combine)."""
    fits = [r for r in explanation.presets if not (r.over_budget or r.over_time)
            and r.error < explanation.measured_error]
    return min(fits, key=lambda r: (r.error, r.slowdown, r.peak), default=None)


def preset_solution(costs, policy) -> solver.Solution:
    """A policy priced by the model: each site at the option the policy gives it (keep where
    it gives none the planner offers), each block it checkpoints recomputed."""
    from ...apply.compress import match

    chosen = match(costs.reference.model, policy).chosen
    checkpointed = {name for name, (_, rule) in chosen.items()
                    if rule.apply == Checkpoint.name}
    offloaded = {name for name in checkpointed if chosen[name][1].option("offload")}
    choice = []
    for site, priced in zip(costs.sites, costs.problem.sites, strict=True):
        rule = chosen.get(site.layers[0], (None, None))[1]
        label = None if rule is None else METHODS[rule.apply].label(rule)
        names = [o.name for o in priced.options]
        blocked = site.block in checkpointed
        choice.append(names.index(label) if label in names and not blocked else 0)
    recomputed = [b in checkpointed for b in costs.blocks]
    return solver.evaluate(costs.problem, choice, recomputed,
                           [b in offloaded for b in costs.blocks])


def lossless_alternative(plan, shapes) -> Lossless | None:
    """The lossless plan of least modelled time whose exact peak fits the budget, whatever
    the slowdown; None where none does."""
    p = plan.costs.problem
    keeps = replace(p, sites=tuple(replace(s, options=s.options[:1]) for s in p.sites))
    every = p.base_time + sum(s.options[0].time for s in p.sites) + sum(
        b.time + (b.offload_time or 0) for b in p.blocks)  # every block offloaded: the slowest
    try:
        found = solver.solve(keeps, plan.budget, every)
    except Exception:  # noqa: BLE001  (an ActdesignError: no lossless plan fits the model)
        return None
    peak = shapes.run(plan_policy(plan.costs, found)).peak
    if peak > plan.budget:
        return None
    return Lossless(found.time / p.base_time, peak, sum(found.recomputed))


def batch_size(batch) -> int | None:
    """The batch dimension of a batch's first tensor."""
    import torch
    from torch.utils._pytree import tree_leaves

    first = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()),
                 None)
    return None if first is None else int(first.shape[0])


def lines(plan, explanation: Explanation) -> list[str]:
    """The explanation in words, for the plan's table."""
    out = []
    e = plan.solution.error
    if explanation.noise is None:
        out.append("gradient noise: not measured (one calibration batch)")
    else:
        noise = (f"gradient noise on the calibration batches (batch "
                 f"{explanation.calibration_batch}, {explanation.batches} batches): "
                 f"{explanation.noise:.3g}")
        shrunk = explanation.equivalent_batch(e)
        if shrunk is not None:
            noise += (f"; the plan's error {e:.3g} adds as much noise as shrinking the "
                      f"batch from {explanation.training_batch} to {shrunk:.1f}")
        out.append(noise)
    out.append(f"{'preset':<30}{'peak MiB':>12}{'error':>12}{'time':>10}  (modelled time)")
    for r in explanation.presets:
        marks = [m for m, on in (("over budget", r.over_budget),
                                 ("over the time limit", r.over_time)) if on]
        out.append(f"{r.label:<30}{r.peak / 2**20:>12.2f}{r.error:>12.3g}"
                   f"{r.slowdown:>9.3f}x  {', '.join(marks)}".rstrip())
    if explanation.chosen is not None:
        out.append(f"chosen: the preset {explanation.chosen}, whose measured error is below "
                   f"the solver's plan's ({explanation.measured_error:.3g}, measured; its "
                   "sites' errors, added, had priced it lower)")
    if explanation.lossless is not None:
        lossless = explanation.lossless
        out.append(f"llm with {lossless.blocks} block{'s' * (lossless.blocks != 1)} "
                   f"recomputed fits with no error at {lossless.slowdown:.2f}x "
                   f"(peak {lossless.peak / 2**20:.2f} MiB); raise --max-slowdown to "
                   f"{lossless.slowdown:.2f} to choose it")
    return out
