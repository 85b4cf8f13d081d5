"""`compress(model, policy)`: apply a policy to a model in place, and say what changed.

Modules are replaced in their parents and every parameter object is kept under its own name,
so the state dict, the parameters' order and a checkpoint are the untouched model's.
Modules already compressed are not touched again, so compressing twice changes nothing; a
model compressed by one policy is refused another (the model records the rules). What
a rule targets but cannot handle is left alone and listed with the reason; a gated MLP or a
head its rule refuses leaves its layers to the other rules in the same pass.

Plan, then apply: `plan` makes every decision, runs every probe and builds every replacement
without changing the model; applying is assignments only (`edits`), taken back if one fails
or the closing probe raises. So a refusal or a fault leaves the model as it was.

Sharing a norm's x̂ with its readers needs one probe forward to see which layers read its
output: pass `example_inputs` (a tensor, a tuple of positional arguments or a dict of
keywords); a transformers model gets a small random batch when none is given. With a probe,
the report also measures the bytes saved for the backward on that input, before and after,
and a policy that keeps more than the model did is refused unless `allow_more` (a compressed
copy of a tensor another reader still keeps whole frees nothing and costs its own bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from actdesign.errors import ActdesignError, TooSlow

from .. import models
from ..methods import METHODS
from ..methods.edits import Edit, apply_all, undo_all
from ..methods.keep import Keep
from ..methods.targets import peft_refusal, target_of
from ..ops.draws import probing
from ..ops.known_modules import is_lora_linear
from . import policy as policy_mod
from .accounting import SavedBytes, account
from .trace import norm_consumers, record_saves


@dataclass
class Change:
    name: str
    old: str  # the replaced module's class
    new: str  # what replaced it, in words


@dataclass
class Report:
    policy: str
    replaced: list[Change] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, class, why)
    before: SavedBytes | None = None  # bytes saved for the probe's backward
    after: SavedBytes | None = None
    compressed: int = 0  # modules a compress made before this one
    unmatched: list[str] = field(default_factory=list)  # rules no module of the model matches

    def to_dict(self) -> dict:
        out = {"policy": self.policy,
               "replaced": [{"name": c.name, "old": c.old, "new": c.new}
                            for c in self.replaced],
               "skipped": [{"name": n, "type": t, "why": w} for n, t, w in self.skipped],
               "already_compressed": self.compressed, "unmatched_rules": self.unmatched}
        if self.before is not None:
            out["probe_saved_bytes"] = {"before": self.before.total,
                                        "after": None if self.after is None else self.after.total}
        return out

    def __str__(self) -> str:
        head = f"{len(self.replaced)} modules replaced, {len(self.skipped)} left alone"
        if not self.replaced and self.compressed:
            head = f"already compressed: nothing to do ({len(self.skipped)} left alone)"
        elif not self.replaced and not self.skipped:
            head = "nothing to do: no module is of a kind the policy compresses"
        lines = [f"compress ({self.policy}): {head}"]
        for c in self.replaced:
            lines.append(f"  {c.name}: {c.old} -> {c.new}")
        for name, kind, why in self.skipped:
            lines.append(f"  left alone {name} ({kind}): {why}")
        for rule in self.unmatched:
            lines.append(f"  matched nothing: {rule} (the model has no such module)")
        if self.before is not None and self.after is not None:
            lines.append(f"  saved for backward on the probe input: {self.change()}")
        return "\n".join(lines)

    def change(self) -> str:
        """The probe's saved bytes, before -> after, in words."""
        b, a = self.before.total, self.after.total
        share = "" if not b else f", {1 - a / b:.1%} less" if a <= b else f", {a / b - 1:.1%} more"
        return f"{_kib(b)} -> {_kib(a)}{share}"

    def keeps_more(self) -> bool:
        return self.before is not None and self.after is not None \
            and self.after.total > self.before.total

    def grown(self) -> list[tuple[str, int]]:
        """(module, bytes more) for the modules that keep more on the probe than before, the
        most first: copies of tensors another reader keeps whole (counted once, at the first)."""
        before = self.before.by_module
        grown = [(name, n - before.get(name, 0)) for name, n in self.after.by_module.items()
                 if n > before.get(name, 0)]
        return sorted(grown, key=lambda item: -item[1])


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def _refusal(report: Report) -> str:
    grown = report.grown()
    named = ", ".join(f"{name or '(model)'} (+{_kib(n)})" for name, n in grown[:4])
    more = f" and {len(grown) - 4} more" if len(grown) > 4 else ""
    return (f"compress ({report.policy}) keeps more for the backward than the model did on the "
            f"probe input ({report.change()}), where {named or 'no one module'}{more} keep "
            "more: a compressed copy frees nothing while another reader keeps the tensor "
            "whole; nothing was changed (allow_more=True applies it anyway)")


@dataclass
class Plan:
    """What `compress` would do: the report, and the edits that do it (assignments only)."""
    report: Report
    edits: list[Edit]
    run: object = None  # the probe forward, when there is one


def compress(model: nn.Module, policy="fewbit3", example_inputs=None, *,
             dry_run: bool = False, allow_more: bool = False) -> Report:
    """Apply `policy` (a preset such as "fewbit3+msnorm", a dict, a Policy or a .json file)
    to `model` in place. Returns a Report of what was replaced, what was left alone and why,
    and, with a probe input, the bytes saved for the backward before and after. With
    `dry_run`, only the report, the probe's bytes after included (measured on the plan applied
    and then taken back): the model is as it was. A policy under which the probe keeps more
    bytes than the model did is refused (an ActdesignError naming the modules that keep more),
    unless `allow_more`; a dry run only reports it. If anything fails, the model is as it was.
    The random number generators and the buffers a forward updates (a
    BatchNorm's running statistics) are left as they were too (the probes run the model), so
    the training run after compress is the one it would have been."""
    _refuse_unsupported(model)
    with probing(model):
        planned = plan(model, policy, example_inputs)
        if dry_run and planned.run is None:
            return planned.report
        apply_all(planned.edits)
        try:
            if planned.run is not None:
                with torch.enable_grad():
                    planned.report.after, _ = account(model, planned.run)
            if planned.report.keeps_more() and not (allow_more or dry_run):
                raise ActdesignError(_refusal(planned.report))
        except BaseException:
            undo_all(planned.edits)
            raise
        if dry_run:  # the probe's bytes measured as the real run measures them, then undone
            undo_all(planned.edits)
    return planned.report


class Draft:
    """A plan in the making: what compress knows of the model, and what the methods leave for
    each other while they plan it (`methods.base.Method`).

    - `chosen`: {name: (module, rule)}, the modules a rule applies to, in the model's order;
      `made`: {name: method}, those an earlier compress applied a method to; `planned`: what
      a method planned for a module at matching (a fused loss's edits), by name;
    - `codes`: {Linear layer: (bits, group size)}, the layers keeping ActNN codes of their
      input; `kept`: those whose input (an activation: what it keeps) another op keeps
      anyway, found by the probe;
    - `exact`, `sharing`: the layers reading an MS norm's x̂, or its codes of x̂;
      `norm_readers`: every layer reading an MS norm;
    - `rebuilt`: {layer: what rebuilds its input, in words} (MS-GLU's down projection);
      `covered`: the layers a composite (a gated MLP, a fused loss) took over;
    - `new`: {module: its replacement}; `edits`: the other assignments, in order.
    """

    def __init__(self, model, policy, inputs, report):
        self.model, self.policy, self.inputs, self.report = model, policy, inputs, report
        self.names = {m: name for name, m in model.named_modules()}
        self.run = None if inputs is None else (lambda: models.call(model, inputs))
        self.chosen, self.made, self.planned = {}, {}, {}
        self.codes, self.kept = {}, set()
        self.exact, self.sharing, self.norm_readers = set(), set(), []
        self.rebuilt, self.covered = {}, set()
        self.new, self.edits = {}, []

    def rule_for(self, name, module, target):
        """The policy's first rule for `module`, of kind `target`, at `name`, or None."""
        return self.policy.rule_for(name, module, target)

    def kept_as_is(self, name, layer) -> bool:
        """Whether the policy keeps the Linear layer at `name` as it is."""
        rule = self.rule_for(name, layer, "linear")
        return rule is not None and rule.apply == Keep.name

    def readers_of(self, norms: dict) -> dict:
        """{norm name: the Linear-like layers reading its output, or why it has another use},
        from one probe forward (`trace.norm_consumers`)."""
        return norm_consumers(self.model, norms, self.run)

    def swap(self, name, module, new, words) -> None:
        """`new` in `module`'s place wherever it appears, said in the report."""
        self.new[module] = new
        self.said(name, type(module).__name__, words)

    def said(self, name, old, words) -> None:
        self.report.replaced.append(Change(name, old, words))

    def skip(self, name, module, why) -> None:
        self.report.skipped.append((name or "(model)", type(module).__name__, why))


def plan(model: nn.Module, policy="fewbit3", example_inputs=None) -> Plan:
    """Every decision, probe and check of `compress`, and the replacements built, without
    changing the model (probes may run it, and hooks added for them are removed): each
    method's steps (`methods.base.Method`) on one draft."""
    _refuse_unsupported(model)
    policy = policy_mod.load(policy)
    _refuse_wrapped(model)
    _refuse_another_policy(model, policy)
    report = Report(policy.label, compressed=sum(map(_ours, model.modules())))
    if not report.compressed:  # else an earlier compress may have taken what a rule targets
        report.unmatched = _unmatched_rules(model, policy)
    draft = match(model, policy, _probe_inputs(model, example_inputs), report)
    if draft.run is not None:
        with torch.enable_grad():
            report.before, _ = account(model, draft.run)
    for name, (m, rule) in draft.chosen.items():
        draft.codes |= METHODS[rule.apply].codes(name, m, rule, draft)
    copying = {m for m, rule in draft.chosen.values()
               if isinstance(m, nn.Conv2d) and METHODS[rule.apply].copies_conv_input}
    tables = {m for m, rule in draft.chosen.values() if METHODS[rule.apply].codes_what_it_keeps}
    if draft.run is not None and (draft.codes or copying or tables):
        saves = record_saves(model, set(draft.codes) | copying, draft.run)
        planned = {m for m, _ in draft.chosen.values()}
        # coded inputs kept by anything uncoded; copied conv inputs, and what a coded
        # activation keeps, by a module no rule replaces
        draft.kept = saves.inputs_kept_elsewhere(set(draft.codes)) | \
            saves.inputs_kept_elsewhere(copying, planned=planned) | \
            saves.own_kept_elsewhere(tables, planned=planned)
    for method in METHODS.values():
        chosen = {n: c for n, c in draft.chosen.items() if c[1].apply == method.name}
        if chosen:
            method.prepare(chosen, draft)
    for name, (m, rule) in draft.chosen.items():
        method = METHODS[rule.apply]
        try:
            if is_lora_linear(m):
                draft.covered.add(m)
                method.replace_lora(name, m, rule, draft)
            else:
                method.replace(name, m, rule, draft)
        except TooSlow:  # the user's expression took too long: an error, not a reason
            raise
        except ActdesignError as exc:
            draft.skip(name, m, str(exc))
    for method in METHODS.values():
        method.finish(draft)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    report.replaced.sort(key=lambda c: order[c.name])
    report.skipped.sort(key=lambda s: order.get(s[0], 0))  # "(model)" first
    edits = _swaps(model, draft.new) + draft.edits
    if edits:  # what a later compress checks its policy against
        edits.append(Edit(model, _POLICY, (policy.label, policy.to_dict()["rules"])))
    return Plan(report, edits, draft.run)


# The attribute on a compressed model holding (label, rules) of the policy that compressed it.
_POLICY = "_actdesign_policy"


def _refuse_another_policy(model, policy) -> None:
    """A model compressed by one policy is refused another: the second would apply its rules
    on top of the first's modules, a mix neither policy describes. The same rules again
    find nothing to do."""
    rules = policy.to_dict()["rules"]
    for m in model.modules():
        label, earlier = m.__dict__.get(_POLICY, (None, rules))
        if earlier != rules:
            raise ActdesignError(f"the model is already compressed with policy {label!r}: "
                                 f"compress the uncompressed model with {policy.label!r}, or "
                                 f"give {label!r} again (nothing to do)")


def _unmatched_rules(model, policy) -> list[str]:
    """The rules (besides 'keep') whose target kind, names and types no module matches (a
    TorchScript module and its parts aside: `match` lists them as left alone)."""
    found, scripts = [], []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) or any(name.startswith(s + ".")
                                                         for s in scripts):
            scripts.append(name)
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if name else None
        found.append((name, m, target_of(m, parent)))
    return [_rule_words(i, rule) for i, rule in enumerate(policy.rules, 1)
            if rule.apply != Keep.name and not any(rule.matches(name, m, kind)
                                                   for name, m, kind in found)]


def match(model, policy, inputs=None, report=None) -> Draft:
    """A draft of the plan with the model's modules matched: `chosen` ({name: (module, first
    matching rule)} for the modules a rule applies to, `keep` aside), `made` (the modules an
    earlier compress applied a method to), `planned` (what methods planned at matching, on
    `inputs` where given), and in `report` the modules that match but cannot be replaced.

    A gated MLP or a causal LM's head that its rule refuses is reported, and its parts are
    matched by the other rules in the same pass: a second compress finds nothing to do. A
    block recomputed leaves its parts to their own rules."""
    draft = Draft(model, policy, inputs, report or Report(policy.label))
    modules = dict(model.named_modules())
    # What these modules hold is planned with them, or left alone with them: a chosen gated
    # MLP's layers (but LoRA layers on them), a LoRA layer's base and adapters, what a PEFT
    # layer compress does not support holds, a TorchScript module's parts; a fused loss's head.
    glus, owners, heads = set(), [], set()
    for name, m in model.named_modules():
        owner = next((o for o in owners if name.startswith(o + ".")), None)
        if owner is not None and not (owner in glus and is_lora_linear(m)):
            continue
        why = peft_refusal(m) or _script_refusal(m)
        if why is not None:
            draft.report.skipped.append((name, type(m).__name__, why))
            owners.append(name)
            continue
        if is_lora_linear(m):
            owners.append(name)
        target = target_of(m, modules.get(name.rpartition(".")[0]) if name else None)
        if target is None or id(m) in heads:
            continue
        made = next((method for method in METHODS.values()
                     if target in method.targets and method.made(m)), None)
        if made is not None:  # its parts are matched below
            draft.made[name] = made.name
            continue
        rule = policy.rule_for(name, m, target)
        if rule is None or rule.apply == Keep.name:
            continue
        if not name and target != "head":
            draft.skip(name, m, "compress replaces submodules: wrap the module in a container")
            continue
        try:  # a composite refused releases its parts to the other rules
            METHODS[rule.apply].check(name, m, rule, draft)
        except TooSlow:
            raise
        except ActdesignError as exc:
            draft.skip(name, m, str(exc))
            continue
        draft.chosen[name] = (m, rule)
        if target == "glu":
            glus.add(name)
            owners.append(name)
        if target == "head" and type(m.get_output_embeddings()) is nn.Linear:
            heads.add(id(m.get_output_embeddings()))
    return draft


def _ours(m) -> bool:
    """A module a compress made, or gave a forward of ours."""
    return type(m).__module__.startswith(("actdesign.", "actdesign_ops_")) \
        or any(method.attached(m) for method in METHODS.values())


def _rule_words(index, rule) -> str:
    where = "" if rule.names == ("*",) else f" {', '.join(rule.names)}"
    kinds = f" of type {', '.join(rule.types)}" if rule.types else ""
    return f"rule {index}, {rule.apply} on {rule.target}{where}{kinds}"


def _refuse_wrapped(model) -> None:
    """A model already wrapped for distributed training (DDP, FSDP, FSDP2) is refused: its
    wrapper has registered the parameters and hooks it synchronises, which replacing modules
    would bypass (DDP would step on unsynchronised gradients, silently)."""
    from torch.distributed.tensor import DTensor

    wrapped = next((type(m).__name__ for m in model.modules()
                    if type(m).__name__ in ("DistributedDataParallel", "DataParallel",
                                            "FullyShardedDataParallel")
                    or any(c.__name__ == "FSDPModule" for c in type(m).__mro__)), None)
    if wrapped is None and any(isinstance(p, DTensor) for p in model.parameters()):
        wrapped = "DTensor parameters"
    if wrapped is not None:
        raise ActdesignError(f"the model is already wrapped for distributed training "
                             f"({wrapped}): compress the plain model first, then wrap it "
                             "(DDP, fully_shard) and build the optimizer")


def _script_refusal(m) -> str | None:
    if isinstance(m, torch.jit.ScriptModule):
        return ("a TorchScript module (scripted or traced) runs its own compiled code: "
                "compress the eager module, then script or trace it")
    return None


def _refuse_unsupported(model) -> None:
    """Only a plain torch module, not a scripted or traced one, can be compressed."""
    if not isinstance(model, nn.Module):
        got = "None" if model is None else f"a {type(model).__name__}"
        raise ActdesignError(f"compress takes a torch.nn.Module, got {got}")
    if isinstance(model, torch.jit.ScriptModule):
        raise ActdesignError("the model is a TorchScript module (scripted or traced), whose "
                             "compiled code compress cannot change: compress the eager model, "
                             "then script or trace it")


def _probe_inputs(model, example_inputs):
    if example_inputs is None and models.transformers_model(model) is not None:
        example_inputs = models.example_batch(model, batch=2, seq=8)
    return example_inputs


def _swaps(model, new: dict) -> list[Edit]:
    """The edits putting each replacement wherever its module appears (shared modules too)."""
    edits = []
    for name, m in model.named_modules(remove_duplicate=False):
        if m in new:
            parent, _, attr = name.rpartition(".")
            edits.append(Edit(model.get_submodule(parent), attr, new[m]))
    return edits
