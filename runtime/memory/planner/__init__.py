"""`plan`: the compression of every site of a model with the least gradient error whose
training step fits a memory budget.

A site is a place a lossy method can act: an activation, or the Linear/Conv layers that read
one tensor (q, k and v read one normed input: one site, since they share its codes), or a
conv net's chain (a batch norm's codes, the ReLU masks after it and the convs rebuilding
their input from them: one set of codes, one choice of bits). A block (a layer of the model's
layer list) is a unit of recomputation. A lossless preset applies wherever it can, at no
cost: of `llm` (MS norms, MS-GLU, RoPE, the fused loss, lean layers) and `cnn` (the
convolutional chains), the one keeping fewer bytes at the target shape.

Each site's options are priced three ways:
- bytes: one shape-only step (`estimate`'s fake tensors, at the target shape) per class of
  sites (the same site in every block) and option; a site's bytes are the change in the
  saved bytes of its block. A block's recomputation keeps its input, and while its
  backward runs it holds what it re-materialises and its working memory (one more step,
  with every block recomputed, measures both per block). The plan's peak is then checked by
  a shape-only step of the planned policy itself, and a plan over the budget is planned
  again under a budget lowered by the excess, so the peak reported is the exact one.
- gradient error: what the option adds to E‖ĝ − g‖² / E‖g‖² of the parameter gradient, on
  the calibration batches and the model's weights, dropout off (its noise is not the
  method's), against the lossless model's gradient. One forward and backward per batch for
  the reference, and one per option of each class of sites, with every site of the class
  compressed (so the count does not grow with depth). A class's measured error is split
  among its sites by what each adds locally: ‖δ‖² of an activation's input gradient, a
  layer's own weight gradient error. Per class, not per kind: a layer's codes reach more
  than its own weight where a norm or a gated MLP shares them (the norm's backward reads
  them), and how far differs from class to class. A chain is measured alone: its norm's
  codes reach every gradient before it, and nothing local tells its share. Errors of
  different sites add (unbiased or independent errors: their cross terms vanish in
  expectation). An option that saves
  no bytes at the target shape (its input is kept anyway) is not offered, nor measured.
- time: from the named card's costs (`cards`): measured on the card where the repository
  holds its measurements (a step's FLOPs at the measured step rate, a lossy option its
  measured time per byte of input), else the roofline of its peak FLOP rate and bandwidth.
  A recomputed block costs its forward's FLOPs (a third of its step's), a lossy option the
  time its kernels add (roofline: the bytes they move, reading the input and writing its
  codes, then reading the codes and writing the input back). A recomputed block may also
  keep its input in host memory (`"offload": true`): off the card between its forward and
  its backward, back with the next block's while its backward runs, at its two copies' time
  over the card's host link (measured, else the sheet's PCIe rate), counted whole.
The choice is designer.plan's exact solver.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from actdesign.errors import ActdesignError
from actdesign.options import parse_budget

from ...models import batches as batch_forms
from ...ops.known_modules import is_channel_norm
from .. import cards
from . import explain as explain_mod
from .costs import Costs, ShapeStep, ShapeSteps, measure_costs
from .errors import Reference, calibration_copy, measure_errors
from .report import MemoryPlan, Point, draw_front, front, measure_policy
from .sites import (
    LOSSLESS,
    PRESETS,
    Site,
    blocks_of,
    checkpoint_rules,
    class_of,
    find_sites,
    kinds,
    labelled,
    options,
    plan_policy,
    policy_of,
    preset_policy,
    site_rules,
)
from .solve import Clock, candidates, smallest_budget, solve_verified

__all__ = ["LOSSLESS", "PRESETS", "ActdesignError", "Clock", "Costs", "MemoryPlan",
           "Point", "Reference", "ShapeStep", "ShapeSteps", "Site", "blocks_of", "calibration_copy",
           "candidates", "cards", "checkpoint_rules", "class_of", "draw_front", "find_sites",
           "front", "labelled", "measure_costs", "measure_errors", "measure_policy",
           "kinds", "options", "plan", "plan_policy", "policy_of", "preset_policy", "site_rules",
           "smallest_budget", "solve_verified"]


def plan(model: nn.Module, batches, budget, *, example_inputs=None, precision="bf16-autocast",
         max_slowdown: float = 1.10, device: str = "h200", kernels: str = "cuda",
         calibration: str = "the given batches", progress=None,
         explain: bool = True) -> MemoryPlan:
    """The policy with the least gradient error whose training step, at the shape of
    `example_inputs` (default: the first batch), has an activation peak within `budget`
    (bytes, a size such as "20GiB", or a fraction of the uncompressed model's saved bytes)
    and a modelled step time within `max_slowdown` times the lossless one's. `batches`: the
    calibration batches, in any form of `models.batches` (a tensor, a dict of keyword inputs,
    a tuple of positional inputs or an (inputs, targets) pair; a transformers model given
    labels computes its own loss). With `explain`, the plan also holds every preset beside
    it, the lossless plan a larger slowdown would allow, and its error beside the gradient's
    own noise (planner.explain). The model is not changed."""
    limit = parse_budget(budget)  # a bad budget refused before anything is measured
    card = cards.card(device)
    if not (isinstance(max_slowdown, int | float) and max_slowdown >= 1):
        raise ActdesignError(f"max_slowdown must be a number >= 1, got {max_slowdown!r}")
    batches = list(batch_forms.iterate(batches))
    if not batches:
        raise ActdesignError("plan needs at least one calibration batch")
    example = batches[0] if example_inputs is None else example_inputs
    clock = Clock(progress)
    zeroed = [name for name, m in model.named_modules() if is_channel_norm(m)
              and getattr(m, "weight", None) is not None and not m.weight.any()]
    if zeroed:  # timm zero-initialises each block's last norm
        clock.say(f"warning: {len(zeroed)} norm(s) have a zero scale ({zeroed[0]}, ...): every "
                  "gradient before them in their blocks is zero, and so is the error of every "
                  "option there; plan on trained weights")
    costs = measure_costs(model, batches, example, precision, card, kernels, calibration,
                          clock)
    if isinstance(limit, float):  # a fraction of the uncompressed model's saved bytes
        limit = int(limit * costs.baseline_saved)
    result = solve_verified(model, example, costs, limit, max_slowdown, precision, kernels,
                            clock)
    if explain:
        clock.say("the presets and the alternatives, for the explanation")
        shapes = ShapeSteps(model, example, precision, kernels)
        presets = {n: preset_policy(costs, n) for n in PRESETS[costs.base]}
        explanation = explain_mod.explain(result, shapes, list(presets.items()))
        better = explain_mod.better_preset(explanation)
        if better is not None:  # a preset that fits measured better: it is the plan
            policy = presets[better.label]
            step = shapes.run(policy)
            solution = replace(explain_mod.preset_solution(costs, policy), error=better.error)
            result = replace(result, policy=policy, saved_bytes=step.saved.total,
                             peak_bytes=step.peak, solution=solution)
            explanation.chosen = better.label
        result.explanation = explanation
        clock.lap("explain")
    return result
