"""The bytes and time of every option, priced by shape-only steps at the target shape, and
the solver's problem they make (with the errors of `errors`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actdesign.designer import plan as solver

from ...apply import policy as policy_mod
from ...methods import option_label
from .. import cards
from .errors import Reference, measure_errors
from .sites import (
    BASES,
    LOSSLESS,
    Site,
    blocks_of,
    checkpoint_rules,
    class_of,
    find_sites,
    options,
    policy_of,
    site_rules,
)


@dataclass
class Costs:
    """Everything the solver needs, and where it came from."""
    sites: list[Site]
    blocks: list[str]
    problem: solver.Problem
    baseline_saved: int  # the uncompressed model's saved bytes at the target shape
    baseline_peak: int
    lossless_saved: int
    passes: dict[str, int]  # site kind -> calibration passes per batch (the reference's aside)
    calibration: str  # what the errors were measured on
    card: cards.Card  # what time costs
    reference: Reference  # prices other policies' errors
    base: str = LOSSLESS  # the lossless preset the plan builds on


def measure_costs(model, batches, example, precision, card, kernels, calibration,
                  clock) -> Costs:
    shapes = ShapeSteps(model, example, precision, kernels)
    baseline = shapes.run(policy_mod.load("none"))
    # the lossless base keeping the fewest bytes (the first of a tie)
    steps = {b: shapes.run(policy_of([], b), flops=True) for b in BASES}
    base = min(BASES, key=lambda b: steps[b].saved.total)
    lossless = steps[base]
    sites = find_sites(model, batches[0], base)
    blocks = blocks_of(model)
    classes: dict[str, list[Site]] = {}
    for s in sites:
        classes.setdefault(class_of(s), []).append(s)
    clock.say(f"{len(sites)} sites in {len(classes)} classes, {len(blocks)} blocks, on {base}")
    clock.say("bytes of each option, per class of sites")
    delta = {}  # (site, option label) -> change of saved bytes
    spread = {}  # (site across blocks, option label) -> {block: its change of saved bytes}
    offered = {}  # class -> the options that save bytes at this shape
    for name, members in classes.items():
        offered[name] = []
        for method, opts in options(members[0].kind):
            label = option_label(method, opts)
            step = shapes.run(policy_of([r for s in members for r in site_rules(s, method, opts)],
                                        base))
            for s in members:
                delta[s, label] = _within(step, s.block, members) - _within(lossless, s.block,
                                                                             members)
                if s.block is None:
                    spread[s, label] = {b: step.block_bytes(b) - lossless.block_bytes(b)
                                        for b in blocks}
            if any(delta[s, label] < 0 for s in members):
                offered[name].append(label)
    recomputed = shapes.run(policy_of(checkpoint_rules(blocks), base), windows=blocks) \
        if blocks else None
    clock.lap("bytes")

    clock.say("gradient errors on the calibration batches")
    reference = Reference(model, batches, base)
    errors, passes = measure_errors(reference, classes, offered)
    clock.lap("errors")

    block_index = {b: i for i, b in enumerate(blocks)}
    problem_sites, inner = [], {b: lossless.block_bytes(b) for b in blocks}
    outside = lossless.activations - sum(inner.values())
    for s in sites:
        labels = offered[class_of(s)]
        keep = max(0, *(-delta[s, label] for label in labels)) if labels else 0
        priced = [solver.Option("keep", keep, 0.0, 0.0)]
        for label in labels:
            n = keep + delta[s, label]
            priced.append(solver.Option(label, n, errors[s, label],
                                        card.option_time(label, keep, n)))
        problem_sites.append(solver.Site(s.name, tuple(priced), block_index.get(s.block)))
        if s.block is not None:
            inner[s.block] -= keep
            continue
        # a site outside every block may keep bytes inside several (a residual stream's
        # chain): those leave the blocks' own bytes, split as its most saving option saves
        # them, so that a block recomputed frees only its own (the site's stay counted)
        if keep:
            best = min(labels, key=lambda label: delta[s, label])
            for b, change in spread[s, best].items():
                moved = min(max(0, -change), inner[b], keep)
                inner[b] -= moved
                keep -= moved
        outside -= keep
    # a recomputed block runs its forward again: a third of its step's FLOPs, and it writes
    # what it saves once more; while its backward runs, it holds what the step with every
    # block recomputed held then beyond its saved bytes (a block whose backward is not one
    # window takes the solver's bound); its input may wait on the host, at the copies' time
    problem_blocks = [solver.Block(b, recomputed.block_bytes(b), inner[b],
                                   card.recompute_time(lossless.flops_of(b) / 3,
                                                       lossless.block_bytes(b)),
                                   recomputed.held_bytes(b),
                                   card.offload_time(recomputed.block_bytes(b)))
                      for b in blocks]
    base_time = card.step_time(lossless.flops, lossless.saved.total)
    problem = solver.Problem(tuple(problem_sites), tuple(problem_blocks), outside,
                             lossless.peak - lossless.activations, base_time)
    return Costs(sites, blocks, problem, baseline.saved.total, baseline.peak,
                 lossless.saved.total, passes, calibration, card, reference, base)


def _within(step, block, members) -> int:
    """The saved bytes a class's change moves for a site: its block's, or (a site outside
    every block, alone in its class) the whole step's."""
    if block is not None:
        return step.block_bytes(block)
    assert len(members) == 1
    return step.activations


@dataclass
class ShapeStep:
    saved: object  # SavedBytes
    peak: int
    flops: int = 0
    flops_by_module: dict = field(default_factory=dict)
    window_peaks: dict = field(default_factory=dict)  # block -> most bytes alive in its backward

    @property
    def activations(self) -> int:
        """The saved bytes the peak counts: the step's own inputs (an image a first
        convolution keeps) are the caller's, alive whatever is kept."""
        return self.saved.total - sum(self.saved.given.values())

    def block_bytes(self, block: str) -> int:
        """The saved bytes of a block's modules, the step's own inputs aside."""
        return sum(n - self.saved.given.get(name, 0) for name, n in self.saved.by_module.items()
                   if name == block or name.startswith(block + "."))

    def held_bytes(self, block: str) -> int | None:
        """The most bytes alive beyond the saved ones while the block's backward ran."""
        peak = self.window_peaks.get(block)
        return None if peak is None else max(0, peak - self.activations)

    def flops_of(self, name: str) -> int:
        return self.flops_by_module.get(name, 0)


class ShapeSteps:
    """Shape-only training steps of copies of the model at the target shape: bytes without
    running anything."""

    def __init__(self, model, example, precision, kernels):
        self.model, self.example = model, example
        self.precision, self.kernels = precision, kernels
        self.count = 0

    def run(self, rules, flops=False, label="plan", windows=()) -> ShapeStep:
        from torch.utils.flop_counter import FlopCounterMode

        from ..steps import fake_step

        self.count += 1
        policy = rules if isinstance(rules, policy_mod.Policy) else policy_mod.validate(
            {"format": policy_mod.FORMAT, "rules": rules}, label=label)
        counter = FlopCounterMode(display=False) if flops else None
        window_peaks = dict.fromkeys(windows)
        saved, peak = fake_step(self.model, self.example, policy, self.precision,
                                self.kernels, counter, window_peaks)
        window_peaks = {k: v for k, v in window_peaks.items() if v is not None}
        if counter is None:
            return ShapeStep(saved, peak, window_peaks=window_peaks)
        by_module = {}
        for name, ops in counter.get_flop_counts().items():
            by_module[name.split(".", 1)[1] if "." in name else ""] = sum(ops.values())
        return ShapeStep(saved, peak, counter.get_total_flops(), by_module, window_peaks)
