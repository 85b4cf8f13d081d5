"""The gradient error of an option: E‖ĝ − g‖² / E‖g‖² against the lossless model's parameter
gradients on the calibration batches, dropout off; a class of sites measured together and its
error split among them by what each adds locally."""

from __future__ import annotations

import copy

import torch
from torch import nn

from actdesign.errors import ActdesignError

from ...apply.compress import compress
from ...models import batches as batch_forms
from ...ops.draws import forked_rng
from .sites import Site, labelled, policy_of, site_rules


class Reference:
    """The lossless model's parameter gradients on the calibration batches, dropout off, and
    the error of other policies against them."""

    def __init__(self, model, batches, base):
        self.model, self.batches, self.base = model, batches, base
        reference = calibration_copy(model, policy_of([], base))
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
    of each class of sites, every site of the class compressed, the class's error split among
    its sites by what each adds locally; one per site of a chain's."""
    errors, passes = {}, {}
    for name, together in classes.items():
        kind = together[0].kind
        # a chain's codes of a norm change the gradient of its input, and so every gradient
        # before it: nothing local tells its share, so each chain is measured alone
        for members in [[s] for s in together] if together[0].sources else [together]:
            passes[kind] = passes.get(kind, 0) + len(offered[name])
            _measure(reference, members, kind, offered[name], errors)
    return errors, passes


def _measure(reference, members, kind, labels, errors) -> None:
    """errors[site, label] of each option: every site of `members` compressed at once, the
    error split among them by what each adds locally."""
    for label in labels:
        method, opts = labelled(kind)[label]
        rules = [r for s in members for r in site_rules(s, method, opts)]
        trial = calibration_copy(reference.model, policy_of(rules, reference.base))
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


def _owned(param_name: str, site: Site) -> bool:
    return any(param_name.startswith(layer + ".") for layer in site.layers)


def calibration_copy(model, policy):
    """A copy compressed by `policy`, then dropout turned off: compress decides as for the
    model that trains (with dropout, attention may not keep the input a layer quantizes)."""
    trial = copy.deepcopy(model).train()
    with forked_rng(trial):
        compress(trial, policy, allow_more=True)  # a trial, priced by the planner
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
                    # on a copy: an in-place activation (timm's ReLU) must not change x
                    (exact,) = torch.autograd.grad(original(xr.clone()), xr, kept.pop("g"))
                self.found[site] += float((g.double() - exact.double()).square().sum())

            output.register_hook(out_grad)
            x.register_hook(in_grad)
        return hook

    def __enter__(self):
        return self.found

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
