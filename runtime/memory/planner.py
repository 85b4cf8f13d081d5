"""`plan`: the compression of every site of a model with the least gradient error whose
training step fits a memory budget.

A site is a place a lossy method can act: an activation, or the Linear/Conv layers that read
one tensor (q, k and v read one normed input: one site, since they share its codes). A block
(a layer of the model's layer list) is a unit of recomputation. The lossless methods (`llm`:
MS norms, MS-GLU, RoPE, the fused loss, lean layers) apply wherever they can, at no cost.

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
  them), and how far differs from class to class. Errors of different sites add (unbiased
  or independent errors: their cross terms vanish in expectation). An option that saves
  no bytes at the target shape (its input is kept anyway) is not offered, nor measured.
- time: from the named card's costs (`cards`): measured on the card where the repository
  holds its measurements (a step's FLOPs at the measured step rate, a lossy option its
  measured time per byte of input), else the roofline of its peak FLOP rate and bandwidth.
  A recomputed block costs its forward's FLOPs (a third of its step's), a lossy option the
  time its kernels add (roofline: the bytes they move, reading the input and writing its
  codes, then reading the codes and writing the input back).
The choice is designer.plan's exact solver.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from actdesign.designer import plan as solver
from actdesign.errors import ActdesignError
from actdesign.options import parse_budget

from ..apply import batches as batch_forms
from ..apply import models
from ..apply import policy as policy_mod
from ..apply.compress import compress, match
from ..ops.draws import forked_rng
from ..ops.sharing import whole
from ..ops.targets import activation_name, target_of
from . import cards
from . import explain as explain_mod

LOSSLESS = "llm"
# site kind -> its options after `keep`, as (method, options)
OPTIONS = {
    "activation": [("fewbit", {"bits": b}) for b in (1, 2, 3, 4)] + [("pwl", {"bits": 2})],
    "linear": [("actnn", {"bits": b}) for b in range(1, 9)]
    + [("backrazor", {"ratio": r}) for r in (0.5, 0.9)],
}
OPTIONS["conv2d"] = OPTIONS["linear"] + [("pooled", {"pool": 2})]


def option_label(method: str, options: dict) -> str:
    if not options:
        return method
    return f"{method}{next(iter(options.values())):g}"


@dataclass(frozen=True)
class Site:
    name: str  # how the table names it
    kind: str  # activation, linear or conv2d
    layers: tuple[str, ...]  # the modules a rule names
    block: str | None  # the block it lies in


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
        for name, b, on in zip(self.costs.blocks, p.blocks, self.solution.recomputed,
                               strict=True):
            if on:
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
            lines.append("(none: every site keeps its input, the lossless ops apply)")
        lines.append(f"planned: peak {self.peak_bytes / 2**20:,.2f} MiB ({self.peak_bytes:,} "
                     f"bytes; budget {self.budget:,}), saved {self.saved_bytes / 2**20:,.2f} MiB "
                     f"(uncompressed {self.costs.baseline_saved / 2**20:,.2f}), gradient "
                     f"error {self.solution.error:.3g}{self._measured()}, time "
                     f"{self.solution.time / base:.3f}x "
                     f"of a {base * 1e3:.3g} ms step ({self.costs.card.describe()})")
        lines.append(f"errors measured on {self.costs.calibration}")
        if self.explanation is not None:
            lines += explain_mod.lines(self, self.explanation)
        return "\n".join(lines)


def plan(model: nn.Module, batches, budget, *, example_inputs=None, precision="bf16-autocast",
         max_slowdown: float = 1.10, device: str = "h200", kernels: str = "cuda",
         calibration: str = "the given batches", progress=None,
         explain: bool = True) -> MemoryPlan:
    """The policy with the least gradient error whose training step, at the shape of
    `example_inputs` (default: the first batch), has an activation peak within `budget`
    (bytes, a size such as "20GiB", or a fraction of the uncompressed model's saved bytes)
    and a modelled step time within `max_slowdown` times the lossless one's. `batches`: the
    calibration batches, in any form of `runtime.batches` (a tensor, a dict of keyword inputs,
    a tuple of positional inputs or an (inputs, targets) pair; a transformers model given
    labels computes its own loss). With `explain`, the plan also holds every preset beside
    it, the lossless plan a larger slowdown would allow, and its error beside the gradient's
    own noise (runtime.explain). The model is not changed."""
    limit = parse_budget(budget)  # a bad budget refused before anything is measured
    card = cards.card(device)
    if not (isinstance(max_slowdown, int | float) and max_slowdown >= 1):
        raise ActdesignError(f"max_slowdown must be a number >= 1, got {max_slowdown!r}")
    batches = list(batch_forms.iterate(batches))
    if not batches:
        raise ActdesignError("plan needs at least one calibration batch")
    example = batches[0] if example_inputs is None else example_inputs
    clock = Clock(progress)
    costs = measure_costs(model, batches, example, precision, card, kernels, calibration,
                          clock)
    if isinstance(limit, float):  # a fraction of the uncompressed model's saved bytes
        limit = int(limit * costs.baseline_saved)
    result = solve_verified(model, example, costs, limit, max_slowdown, precision, kernels,
                            clock)
    if explain:
        clock.say("the presets and the alternatives, for the explanation")
        shapes = ShapeSteps(model, example, precision, kernels)
        presets = {n: preset_policy(costs, n) for n in PRESETS}
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


def _tail(name: str, width: int) -> str:
    """A name in `width` characters, keeping its informative end."""
    return name if len(name) <= width else "…" + name[-(width - 1):]


class Clock:
    def __init__(self, progress):
        self.progress, self.start, self.marks = progress, time.perf_counter(), {}

    def say(self, message):
        if self.progress is not None:
            self.progress(f"[{time.perf_counter() - self.start:6.1f} s] {message}")

    def lap(self, name):
        now = time.perf_counter()
        self.marks[name] = round(now - self.start - sum(self.marks.values()), 3)


# --- sites -------------------------------------------------------------------------------

def blocks_of(model) -> list[str]:
    """The blocks: the modules a `checkpoint` rule can name."""
    modules, found = dict(model.named_modules()), []
    for name, m in modules.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        outer = any(name.startswith(b + ".") for b in found)
        if name and not outer and target_of(m, parent) == "block":
            found.append(name)
    return found


def find_sites(model, example) -> list[Site]:
    """Every site a lossy rule can take, in the model's order: the activations with a built-in
    derivative and the Linear/Conv layers compress would quantize, grouped by the tensor they
    read (found by one forward of `example`)."""
    every = {"format": policy_mod.FORMAT, "rules": [
        {"target": "activation", "apply": "fewbit"},
        {"target": "linear", "apply": "actnn"}, {"target": "conv2d", "apply": "actnn"},
        *policy_mod.PRESETS[LOSSLESS]]}
    chosen = match(model, policy_mod.load(every))[0]
    layers = {}  # name -> kind
    for name, (m, rule) in chosen.items():
        if rule.apply == "fewbit" and activation_name(m) is not None:
            layers[name] = "activation"
        elif rule.apply == "actnn":
            layers[name] = "conv2d" if isinstance(m, nn.Conv2d) else "linear"
        elif rule.apply == "msglu":  # its layers are sites; its activation is its own
            for part in ("gate_proj", "up_proj", "down_proj"):
                layers[f"{name}.{part}"] = "linear"
    modules = dict(model.named_modules())
    reads = _inputs_read(model, {n: modules[n] for n in layers}, example)
    groups: dict = {}
    for name, kind in layers.items():
        key = (kind, reads.get(name, name)) if kind != "activation" else (kind, name)
        groups.setdefault(key, []).append(name)
    blocks = blocks_of(model)
    order = {name: i for i, name in enumerate(modules)}
    sites = []
    for (kind, _), names in groups.items():
        names.sort(key=order.get)
        block = next((b for b in blocks if names[0].startswith(b + ".")), None)
        sites.append(Site(_group_name(names), kind, tuple(names), block))
    sites.sort(key=lambda s: order[s.layers[0]])
    return sites


def _group_name(names) -> str:
    if len(names) == 1:
        return names[0]
    head = names[0].rsplit(".", 1)[0]
    if all(n.rsplit(".", 1)[0] == head for n in names):
        return head + ".{" + ",".join(n.rsplit(".", 1)[1] for n in names) + "}"
    return ",".join(names)


def _inputs_read(model, layers: dict, example) -> dict:
    """{layer name: id of the tensor it read} over one forward."""
    from ..apply.accounting import storage_key

    seen = {}

    def hook(name):
        def record(module, args):
            seen.setdefault(name, whole(args[0]))  # held: no storage is reused meanwhile
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        with torch.no_grad(), forked_rng(model):
            models.call(model, example)
    finally:
        for h in handles:
            h.remove()
    return {name: storage_key(t) for name, t in seen.items()}


def class_of(site: Site) -> str:
    """Sites that are one site repeated in every block share a class."""
    if site.block is None:
        return site.name
    # the block's index made a wildcard: model.layers.*.mlp.down_proj
    pattern = re.sub(r"\d+$", "*", site.block)
    return f"{site.kind}:{pattern}{site.name[len(site.block):]}"


def labelled(kind: str) -> dict:
    """{option label: (method, options)} of a site kind."""
    return {option_label(m, o): (m, o) for m, o in OPTIONS[kind]}


def site_rules(site: Site, method: str, options: dict) -> list[dict]:
    return [{"target": site.kind, "name": list(site.layers), "apply": method, **options}]


def policy_of(rules: list[dict], label="plan") -> policy_mod.Policy:
    base = policy_mod.PRESETS[LOSSLESS]
    return policy_mod.validate({"format": policy_mod.FORMAT, "rules": [*rules, *base]},
                               label=label)


def checkpoint_rules(blocks) -> list[dict]:
    return [{"target": "block", "name": list(blocks), "apply": "checkpoint"}] if blocks else []


# --- costs -------------------------------------------------------------------------------

def measure_costs(model, batches, example, precision, card, kernels, calibration,
                  clock) -> Costs:
    sites = find_sites(model, batches[0])
    blocks = blocks_of(model)
    classes: dict[str, list[Site]] = {}
    for s in sites:
        classes.setdefault(class_of(s), []).append(s)
    clock.say(f"{len(sites)} sites in {len(classes)} classes, {len(blocks)} blocks")

    shapes = ShapeSteps(model, example, precision, kernels)
    baseline = shapes.run(policy_mod.load("none"))
    lossless = shapes.run(policy_of([]), flops=True)
    clock.say("bytes of each option, per class of sites")
    delta = {}  # (site, option label) -> change of saved bytes
    offered = {}  # class -> the options that save bytes at this shape
    for name, members in classes.items():
        offered[name] = []
        for method, opts in OPTIONS[members[0].kind]:
            label = option_label(method, opts)
            step = shapes.run(policy_of([r for s in members for r in site_rules(s, method, opts)]))
            for s in members:
                delta[s, label] = _within(step, s.block, members) - _within(lossless, s.block,
                                                                             members)
            if any(delta[s, label] < 0 for s in members):
                offered[name].append(label)
    recomputed = shapes.run(policy_of(checkpoint_rules(blocks)), windows=blocks) \
        if blocks else None
    clock.lap("bytes")

    clock.say("gradient errors on the calibration batches")
    reference = Reference(model, batches)
    errors, passes = measure_errors(reference, classes, offered)
    clock.lap("errors")

    block_index = {b: i for i, b in enumerate(blocks)}
    problem_sites, inner = [], {b: lossless.block_bytes(b) for b in blocks}
    outside = lossless.saved.total - sum(inner.values())
    for s in sites:
        labels = offered[class_of(s)]
        keep = max(0, *(-delta[s, label] for label in labels)) if labels else 0
        options = [solver.Option("keep", keep, 0.0, 0.0)]
        for label in labels:
            n = keep + delta[s, label]
            options.append(solver.Option(label, n, errors[s, label],
                                         card.option_time(label, keep, n)))
        problem_sites.append(solver.Site(s.name, tuple(options), block_index.get(s.block)))
        if s.block is None:
            outside -= keep
        else:
            inner[s.block] -= keep
    # a recomputed block runs its forward again: a third of its step's FLOPs, and it writes
    # what it saves once more; while its backward runs, it holds what the step with every
    # block recomputed held then beyond its saved bytes (a block whose backward is not one
    # window takes the solver's bound)
    problem_blocks = [solver.Block(b, recomputed.block_bytes(b), inner[b],
                                   card.recompute_time(lossless.flops_of(b) / 3,
                                                       lossless.block_bytes(b)),
                                   recomputed.held_bytes(b)) for b in blocks]
    base_time = card.step_time(lossless.flops, lossless.saved.total)
    problem = solver.Problem(tuple(problem_sites), tuple(problem_blocks), outside,
                             lossless.peak - lossless.saved.total, base_time)
    return Costs(sites, blocks, problem, baseline.saved.total, baseline.peak,
                 lossless.saved.total, passes, calibration, card, reference)


def _within(step, block, members) -> int:
    """The saved bytes a class's change moves for a site: its block's, or (a site outside
    every block, alone in its class) the whole step's."""
    if block is not None:
        return step.block_bytes(block)
    assert len(members) == 1
    return step.saved.total


@dataclass
class ShapeStep:
    saved: object  # SavedBytes
    peak: int
    flops: int = 0
    flops_by_module: dict = field(default_factory=dict)
    window_peaks: dict = field(default_factory=dict)  # block -> most bytes alive in its backward

    def block_bytes(self, block: str) -> int:
        return sum(n for name, n in self.saved.by_module.items()
                   if name == block or name.startswith(block + "."))

    def held_bytes(self, block: str) -> int | None:
        """The most bytes alive beyond the saved ones while the block's backward ran."""
        peak = self.window_peaks.get(block)
        return None if peak is None else max(0, peak - self.saved.total)

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

        from .estimate import fake_step

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


# --- gradient errors ---------------------------------------------------------------------

class Reference:
    """The lossless model's parameter gradients on the calibration batches, dropout off, and
    the error of other policies against them."""

    def __init__(self, model, batches):
        self.model, self.batches = model, batches
        reference = calibration_copy(model, policy_of([]))
        self.grads = [_gradients(reference, b) for b in batches]
        self.energy = sum(_energy(g.values()) for g in self.grads)
        if self.energy == 0:
            raise ActdesignError("the calibration batches give a zero gradient: nothing to "
                                 "plan")

    @property
    def noise(self) -> float | None:
        """The gradient's own noise on the calibration batches, n/(n-1) Σ_b ‖g_b - ḡ‖²
        / Σ_b ‖g_b‖² (unbiased; the error's normalisation); None with one batch."""
        n = len(self.grads)
        if n < 2:
            return None
        names = self.grads[0].keys()
        mean = {k: sum(g[k].double() for g in self.grads) / n for k in names}
        spread = sum(_energy(_differences(g, mean).values()) for g in self.grads)
        return n / (n - 1) * spread / self.energy

    def error(self, policy) -> float:
        """E‖ĝ − g‖² / E‖g‖² of the model compressed by `policy`."""
        trial = calibration_copy(self.model, policy)
        return sum(_energy(_differences(_gradients(trial, b), g).values())
                   for b, g in zip(self.batches, self.grads, strict=True)) / self.energy


def _energy(tensors) -> float:
    return sum(float(t.double().square().sum()) for t in tensors)


def _differences(grads, exact) -> dict:
    return {n: grads[n].double() - g.double() for n, g in exact.items()}


def measure_errors(reference: Reference, classes: dict, offered: dict) -> tuple[dict, dict]:
    """({(site, option label): error}, {kind: passes per batch}): one pass per offered option
    of each class of sites, every site of the class compressed; the class's error split among
    its sites by what each adds locally."""
    errors, passes = {}, {}
    for name, members in classes.items():
        kind = members[0].kind
        passes[kind] = passes.get(kind, 0) + len(offered[name])
        for label in offered[name]:
            method, opts = labelled(kind)[label]
            rules = [r for s in members for r in site_rules(s, method, opts)]
            trial = calibration_copy(reference.model, policy_of(rules))
            local = dict.fromkeys(members, 0.0)
            total = 0.0
            for batch, g in zip(reference.batches, reference.grads, strict=True):
                with _local_errors(trial, members, kind, reference.model) as found:
                    diff = _differences(_gradients(trial, batch), g)
                total += _energy(diff.values())
                for s in members:
                    local[s] += found[s] if kind == "activation" else _energy(
                        d for n, d in diff.items() if _owned(n, s))
            share = sum(local.values())
            for s in members:
                errors[s, label] = total / reference.energy * (
                    local[s] / share if share > 0 else 1 / len(members))
    return errors, passes


def _owned(param_name: str, site: Site) -> bool:
    return any(param_name.startswith(layer + ".") for layer in site.layers)


def calibration_copy(model, policy):
    """A copy compressed by `policy`, then dropout turned off: compress decides as for the
    model that trains (with dropout, attention may not keep the input a layer quantizes)."""
    trial = copy.deepcopy(model).train()
    with forked_rng(trial):
        compress(trial, policy)
    for m in trial.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return trial


def _gradients(model, batch) -> dict:
    model.zero_grad(set_to_none=True)
    with forked_rng(model):
        torch.manual_seed(0)
        batch_forms.loss(model, batch).backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()
           if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


class _local_errors:
    """‖δ‖² of each compressed activation's input gradient against the exact derivative of
    the original activation (`source` holds it) at the same input and output gradient."""

    def __init__(self, trial, members, kind, source):
        self.found = {s: 0.0 for s in members}
        self.handles = []
        if kind != "activation":
            return
        modules, originals = dict(trial.named_modules()), dict(source.named_modules())
        for s in members:
            (name,) = s.layers
            self.handles.append(modules[name].register_forward_hook(
                self._hook(s, originals[name])))

    def _hook(self, site, original):
        def hook(module, args, output):
            x = args[0]
            if not (x.requires_grad and output.requires_grad):
                return
            kept = {}

            def out_grad(g):
                kept["g"] = g.detach()

            def in_grad(g):
                with torch.enable_grad():
                    xr = x.detach().requires_grad_()
                    (exact,) = torch.autograd.grad(original(xr), xr, kept.pop("g"))
                self.found[site] += float((g.double() - exact.double()).square().sum())

            output.register_hook(out_grad)
            x.register_hook(in_grad)
        return hook

    def __enter__(self):
        return self.found

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


# --- solving -----------------------------------------------------------------------------

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
        key = (solution.choice, solution.recomputed)
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


def plan_policy(costs: Costs, solution) -> policy_mod.Policy:
    rules = []
    for i, (site, c) in enumerate(zip(costs.sites, solution.choice, strict=True)):
        if c:
            method, opts = labelled(site.kind)[costs.problem.sites[i].options[c].name]
            rules += site_rules(site, method, opts)
    rules += checkpoint_rules([b for b, on in zip(costs.blocks, solution.recomputed,
                                                  strict=True) if on])
    return policy_of(rules)


# --- the front, and the presets on it ------------------------------------------------------

PRESETS = ("llm", "llm+actnn2", "fewbit3+msnorm", "fewbit3+msnorm+actnn2", "actnn2",
           "llm+checkpoint")


@dataclass
class Point:
    label: str
    saved: int
    peak: int
    error: float  # measured


def preset_policy(costs: Costs, name: str) -> policy_mod.Policy:
    """A preset, or `llm+checkpoint`: llm with every block recomputed."""
    if name == "llm+checkpoint":
        return policy_of(checkpoint_rules(costs.blocks), label=name)
    return policy_mod.load(name)


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
            plan, shapes, [(n, preset_policy(plan.costs, n)) for n in PRESETS])
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
