"""Calibration into a policy file: per-layer tables for the activations, fitted to what each
layer actually sees, and an exact bit allocation for ActNN layers.

1. Each activation's inputs are recorded over the user's batches into a streaming histogram
   (fixed bin count, so memory stays bounded however much data flows).
2. Each layer gets the optimal stepwise table under its own empirical density.
3. If the policy quantizes Linear/Conv inputs (actnn), the compressed model runs the batches
   forward and backward for ActNN's variance weights, and the bits are allocated exactly under
   the same memory as the policy's uniform bits (`runtime.calibrate`).
The result is one policy: a rule per calibrated layer, then the base policy's rules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from actdesign import spec as spec_mod
from actdesign.errors import ActdesignError

from ..apply import policy as policy_mod
from ..apply.compress import compress, match
from ..methods.actnn import ActNN
from ..methods.fewbit import FewBit
from ..models import batches as batch_forms
from ..ops.draws import probing
from ..ops.known_modules import activation_name
from ..ops.tables import table
from .bits import calibrate


class StreamingHistogram:
    """Counts over `bins` equal bins whose range doubles (merging pairs) to take new values."""

    def __init__(self, bins: int = 1024):
        self.bins, self.lo, self.width, self.counts = bins, 0.0, 0.0, None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1)
        x = x[torch.isfinite(x)].cpu()
        if x.numel() == 0:
            return
        lo, hi = x.min().item(), x.max().item()
        if self.counts is None:
            self.lo, self.width = lo, max(hi - lo, 1e-6) * (1 + 1e-6) / self.bins
            self.counts = torch.zeros(self.bins, dtype=torch.float64)
        while lo < self.lo or hi >= self.lo + self.width * self.bins:
            pairs = self.counts.view(-1, 2).sum(1)
            self.counts = torch.zeros_like(self.counts)
            if lo < self.lo:  # the old range becomes the right half
                self.counts[self.bins // 2:] = pairs
                self.lo -= self.width * self.bins
            else:
                self.counts[:self.bins // 2] = pairs
            self.width *= 2
        index = ((x - self.lo) / self.width).floor().long().clamp_(0, self.bins - 1)
        self.counts += torch.bincount(index, minlength=self.bins).double()

    def weight(self, source: str):
        """The designer's empirical weight: the occupied bins only."""
        from actdesign.designer.weights import Histogram

        if self.counts is None or self.counts.sum() == 0:
            raise ActdesignError(f"{source}: no finite values were recorded")
        used = torch.nonzero(self.counts).reshape(-1)
        first, last = int(used[0]), int(used[-1]) + 1
        edges = self.lo + self.width * torch.arange(first, last + 1, dtype=torch.float64)
        return Histogram(edges.numpy(), self.counts[first:last].numpy(), source)


@dataclass
class LayerTable:
    name: str
    activation: str
    bits: int
    error: float  # E of the layer's own table under its empirical density
    error_normal: float  # E of the one-size N(0, 1) table under the same density
    spec: spec_mod.Spec


@dataclass
class Calibration:
    policy: policy_mod.Policy
    tables: list[LayerTable]
    bits: dict  # ActNN layer -> allocated bits

    def __str__(self) -> str:
        lines = [f"{'activation layer':<44}{'E, N(0,1) table':>16}{'E, own table':>14}"
                 f"{'ratio':>8}"]
        for t in self.tables:
            lines.append(f"{t.name[-43:]:<44}{t.error_normal:>16.4g}{t.error:>14.4g}"
                         f"{t.error / t.error_normal if t.error_normal else 1:>8.3f}")
        if self.tables:
            own = sum(t.error for t in self.tables)
            normal = sum(t.error_normal for t in self.tables)
            lines.append(f"{'sum':<44}{normal:>16.4g}{own:>14.4g}"
                         f"{own / normal if normal else 1:>8.3f}")
        if self.bits:
            counts = {}
            for b in self.bits.values():
                counts[b] = counts.get(b, 0) + 1
            lines.append("ActNN bits: " + ", ".join(
                f"{n} layer{'s' if n > 1 else ''} at {b}" for b, n in sorted(counts.items())))
        return "\n".join(lines)


def calibrate_policy(model: torch.nn.Module, batches, policy="fewbit3", *, bits: int | None = None,
                     loss=None, actnn_bits: float | None = None,
                     hist_bins: int = 1024, progress=None) -> Calibration:
    """Per-layer tables (and ActNN bits) for `model` on `batches`, as a policy.

    `batches` is a list, or a function returning a fresh iterable, of batches in any form of
    `models.batches` (a tensor, a dict of keyword inputs, a tuple of positional inputs or an
    (inputs, targets) pair). `policy` is the base: its fewbit
    rules choose which activations get their own table (with the rule's bits, or `bits`), and
    its actnn rules which layers get allocated bits, on average the rule's bits (or
    `actnn_bits`). `loss(model, batch)` defaults to the model's own loss. The model is not
    changed. `progress(message)`, if given, hears each phase as it starts."""
    say = progress or (lambda message: None)
    base = policy_mod.load(policy)
    loss = loss or batch_forms.loss
    fresh = (lambda: batch_forms.iterate(batches())) if callable(batches) \
        else (lambda: batch_forms.iterate(batches))
    targets = _fewbit_targets(model, base, bits)
    tables = _fit_tables(model, targets, _record(model, targets, fresh), say)
    rules = [{"target": "activation", "name": t.name, "apply": FewBit.name, "bits": t.bits,
              "spec": t.spec.to_dict()} for t in tables]
    base_rules = [r.to_dict() for r in base.rules]
    allocated = _allocate(model, base, rules + base_rules, fresh, loss, actnn_bits, say)
    rules += [{"target": "conv2d" if conv else "linear", "name": name, "apply": ActNN.name,
               "bits": b} for name, (b, conv) in allocated.items()]
    rules += base_rules
    result = policy_mod.validate({"format": policy_mod.FORMAT, "rules": rules},
                                 label=f"calibrated {base.label}")
    return Calibration(result, tables, {n: b for n, (b, _) in allocated.items()})


def _fewbit_targets(model, base, bits) -> dict:
    """{name: (module, activation, bits)} for activations the base gives a fewbit table."""
    found = {}
    for name, (m, rule) in match(model, base).chosen.items():
        if rule.apply == FewBit.name and activation_name(m) is not None:
            found[name] = (m, activation_name(m), bits or rule.option("bits"))
    return found


def _record(model, targets, fresh) -> dict:
    hists = {name: StreamingHistogram() for name in targets}
    handles = [m.register_forward_pre_hook(lambda m, args, h=hists[name]: h.add(args[0]))
               for name, (m, _, _) in targets.items()]
    count = 0
    try:
        with torch.no_grad(), probing(model):  # the model is not changed
            for batch in fresh():
                batch_forms.call(model, batch)
                count += 1
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise ActdesignError("calibration got no batches")
    return hists


def _fit_tables(model, targets, hists, say) -> list[LayerTable]:
    from actdesign.designer import fit_stepwise
    from actdesign.designer.stepwise import Problem

    out = []
    for i, (name, (_, act, b)) in enumerate(targets.items()):
        say(f"fitting table {i + 1}/{len(targets)}: {name}, {b} bit(s)")
        weight = hists[name].weight(name)
        fit = fit_stepwise(act, b, weight)
        normal = table("stepwise", act, b)
        error_normal, _ = Problem(fit.activation, weight).error(normal.borders, normal.levels)
        out.append(LayerTable(name, act, b, fit.error, error_normal, spec_mod.from_fit(fit)))
    return out


def _allocate(model, base, rules, fresh, loss, actnn_bits, say) -> dict:
    """{layer: (bits, is conv)} from an exact allocation, if the base policy uses actnn.
    `rules` make the compressed copy the statistics run on."""
    actnn = {r.option("bits") for r in base.rules if r.apply == ActNN.name}
    if not actnn:
        return {}
    if actnn_bits is None and len(actnn) > 1:
        raise ActdesignError("the policy's actnn rules use different bits: give the average "
                             "to allocate (actnn_bits)")
    avg = actnn_bits if actnn_bits is not None else actnn.pop()
    say(f"allocating ActNN bits ({avg:g} on average): a forward and backward per batch")
    trial = copy.deepcopy(model)
    first = next(iter(fresh()))
    compress(trial, {"format": policy_mod.FORMAT, "rules": rules}, example_inputs=first,
             allow_more=True)  # a trial copy, measured for its gradients only
    bits = calibrate(trial, fresh(), avg_bits=avg, loss=loss)
    convs = {n for n, m in trial.named_modules() if isinstance(m, torch.nn.Conv2d)}
    return {name: (int(b), name in convs) for name, b in bits.items()}
