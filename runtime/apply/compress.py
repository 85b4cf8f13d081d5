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
the report also measures the bytes saved for the backward on that input, before and after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn

from actdesign import spec as spec_mod
from actdesign.activation import resolve
from actdesign.designer.allocate import load_bits
from actdesign.errors import ActdesignError

from .. import models
from ..methods.checkpoint import plan_checkpoint
from ..methods.edits import Edit, apply_all, undo_all
from ..methods.fused_ce import plan_fused_loss
from ..methods.lora import plan_lora
from ..methods.rope import plan_rotary
from ..methods.targets import peft_refusal, target_of
from ..ops.cache import load
from ..ops.compressed import LeanLinear
from ..ops.draws import forked_rng
from ..ops.glu import MSGLU
from ..ops.known_modules import activation_name, has_builtin, is_lora_linear
from ..ops.lm_loss import FusedLossHead
from ..ops.lora import LeanLoRA
from ..ops.msact import MSActivation
from ..ops.norms import _QMSNorm, ms_norm
from ..ops.pooled_conv import PooledConv2d
from ..ops.quantized import InputCodes, QConv2d, QLinear
from ..ops.recompute import is_checkpoint_forward
from ..ops.rope import is_rotary_forward
from ..ops.sparse import SparseConv2d, SparseLinear
from ..ops.tables import table
from . import policy as policy_mod
from .accounting import SavedBytes, account
from .trace import inputs_kept_elsewhere, norm_consumers


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
            b, a = self.before.total, self.after.total
            share = f", {1 - a / b:.1%} less" if b else ""
            lines.append(f"  saved for backward on the probe input: {_kib(b)} -> "
                         f"{_kib(a)}{share}")
        return "\n".join(lines)


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


@dataclass
class Plan:
    """What `compress` would do: the report, and the edits that do it (assignments only)."""
    report: Report
    edits: list[Edit]
    run: object = None  # the probe forward, when there is one


def compress(model: nn.Module, policy="fewbit3", example_inputs=None, *,
             dry_run: bool = False) -> Report:
    """Apply `policy` (a preset such as "fewbit3+msnorm", a dict, a Policy or a .json file)
    to `model` in place. Returns a Report of what was replaced, what was left alone and why,
    and, with a probe input, the bytes saved for the backward before and after. With
    `dry_run`, only the report, the probe's bytes after included (measured on the plan applied
    and then taken back): the model is as it was. If anything fails, the
    model is as it was. The random number generators are left as they were too (the probes
    run dropout), so the training run after compress draws what it would have drawn."""
    _refuse_unsupported(model)
    with forked_rng(model):
        planned = plan(model, policy, example_inputs)
        if dry_run and planned.run is None:
            return planned.report
        apply_all(planned.edits)
        try:
            if planned.run is not None:
                with torch.enable_grad():
                    planned.report.after, _ = account(model, planned.run)
        except BaseException:
            undo_all(planned.edits)
            raise
        if dry_run:  # the probe's bytes measured as the real run measures them, then undone
            undo_all(planned.edits)
    return planned.report


def plan(model: nn.Module, policy="fewbit3", example_inputs=None) -> Plan:
    """Every decision, probe and check of `compress`, and the replacements built, without
    changing the model (probes may run it, and hooks added for them are removed)."""
    _refuse_unsupported(model)
    policy = policy_mod.load(policy)
    _refuse_wrapped(model)
    _refuse_another_policy(model, policy)
    report = Report(policy.label, compressed=sum(map(_ours, model.modules())))
    if not report.compressed:  # else an earlier compress may have taken what a rule targets
        report.unmatched = _unmatched_rules(model, policy)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    names = {m: name for name, m in model.named_modules()}
    inputs = _probe_inputs(model, example_inputs)
    chosen, report.skipped, heads = match(model, policy, inputs)
    run = None if inputs is None else (lambda: models.call(model, inputs))
    if run is not None:
        with torch.enable_grad():
            report.before, _ = account(model, run)
    norms = {n: m for n, (m, rule) in chosen.items() if rule.apply == "msnorm"}
    codes = _actnn_layers(chosen, policy)  # Linear -> (bits, group size); a GLU's layers too
    kept = set()
    if run is not None and codes:
        kept = inputs_kept_elsewhere(model, set(codes), run)
    # module -> its replacement; the readers of MS norms keeping x̂ (exact) or codes of it
    new, exact, sharing, readers = _share_norms(model, policy, norms, run, report, codes,
                                                names)
    edits, covered = [], set()  # covered: layers a GLU or a fused loss takes over
    glu_downs = set()  # the down projections of MS-GLUs: they read h, rebuilt from g and u

    def plan_lora_layer(layer, method):
        keeps = _lora_keeps(layer, method, codes, kept, exact, sharing, glu_downs)
        return _plan_lora(names[layer], layer, method, keeps, report)

    for name, (m, rule) in chosen.items():
        if rule.apply == "msnorm":
            continue
        if is_lora_linear(m):
            edits += plan_lora_layer(m, rule.apply)
            covered.add(m)
            continue
        if rule.apply == "actnn" and m in kept | exact:
            # Its input is kept anyway (by an MS norm, or by attention for its backward):
            # codes of it would add bytes and noise, not save them. The exact layer, lean.
            new[m] = LeanLinear.from_module(m)
            why = "an MS norm's x̂" if m in exact else "kept by another op"
            report.replaced.append(Change(name, type(m).__name__, f"LeanLinear (its input "
                                          f"is {why}, kept anyway: no codes)"))
            continue
        try:
            if rule.apply == "fused_ce":  # the model itself: its forward computes the loss
                head, fused = heads[name]  # planned by `match`
                edits += fused
                covered.add(m.get_output_embeddings())
                head = f"{name}.{head}" if name else head  # the causal LM may be inside
                report.replaced.append(Change(head, "Linear", "FusedLossHead (the loss is "
                                              "computed chunk by chunk: no logits kept)"))
                continue
            if rule.apply == "rope":  # the module stays; its forward gets our rotation
                edits.append(plan_rotary(m))
                report.replaced.append(Change(name, type(m).__name__, _rotary_words(m)))
                continue
            if rule.apply == "checkpoint":  # the block stays; its forward is recomputed
                offload = rule.option("offload")
                edits.append(plan_checkpoint(m, offload))
                report.replaced.append(Change(name, type(m).__name__, "recomputed in backward "
                                              "(checkpoint" + (", its input kept in host "
                                                               "memory)" if offload else ")")))
                continue
            new[m], what = _replacement(name, m, rule, codes, sharing)
        except ActdesignError as exc:
            report.skipped.append((name or "(model)", type(m).__name__, str(exc)))
            continue
        if rule.apply == "msglu":
            covered.update((m.gate_proj, m.up_proj, m.down_proj))
            glu_downs.add(m.down_proj)
        report.replaced.append(Change(name, type(m).__name__, what))
    for reader in readers:  # no rule replaced it: it keeps the norm's copy, exact and lean
        if reader in new or reader in covered:
            continue
        if is_lora_linear(reader):
            edits += plan_lora_layer(reader, "lean")
        else:
            new[reader] = LeanLinear.from_module(reader)
            report.replaced.append(Change(names[reader], type(reader).__name__,
                                          "LeanLinear (keeps the MS norm's own copy, "
                                          "not one of its own)"))
    report.replaced.sort(key=lambda c: order[c.name])
    report.skipped.sort(key=lambda s: order.get(s[0], 0))  # "(model)" first
    edits = _swaps(model, new) + edits
    if edits:  # what a later compress checks its policy against
        edits.append(Edit(model, _POLICY, (policy.label, policy.to_dict()["rules"])))
    return Plan(report, edits, run)


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
            if rule.apply != "keep" and not any(
                kind == rule.target and any(fnmatchcase(name, g) for g in rule.names)
                and (not rule.types or type(m).__name__ in rule.types)
                for name, m, kind in found)]


def _rule_words(index, rule) -> str:
    where = "" if rule.names == ("*",) else f" {', '.join(rule.names)}"
    kinds = f" of type {', '.join(rule.types)}" if rule.types else ""
    return f"rule {index}, {rule.apply} on {rule.target}{where}{kinds}"


def _rotary_words(attention) -> str:
    """What rotates q and k where the module's weights are now (`rope.rotary`): one kernel
    for both takes CUDA tensors (in any float dtype, under autocast or not); anywhere else
    eager's own ops run, as before."""
    p = next(attention.parameters(), None)
    device = p.device.type if p is not None else "cpu"
    kernel = "one kernel for q and k each way"
    if device != "cuda":
        return f"rotary embedding: eager's own ops on {device}; {kernel} on CUDA"
    return f"rotary embedding in {kernel}"


def _plan_lora(name, layer, method, keeps, report) -> list[Edit]:
    """The edits giving a PEFT LoRA layer the lean path under a 'lean' or 'actnn' rule;
    `keeps` is (how x is kept for A's gradient, that in words), from `_lora_keeps`. Other
    methods are reported and leave it alone."""
    if method not in ("lean", "actnn"):
        report.skipped.append((name, type(layer).__name__, f"a LoRA layer takes 'lean' or "
                               f"'actnn', not {method!r}"))
        return []
    keeper, kept = keeps
    report.replaced.append(Change(name, "lora.Linear", f"lean LoRA (the frozen base keeps "
                                  f"nothing; the adapter keeps A·drop(x) and {kept}; the "
                                  "dropout mask is replayed)"))
    return plan_lora(layer, keeper)


def _lora_keeps(layer, method, codes, kept, exact, sharing, glu_downs):
    """(keeper, in words) of what a LoRA layer keeps of x for A's gradient: what something
    else keeps anyway where it can, else x, or under 'actnn' codes of x."""
    if layer in glu_downs:
        return LeanLinear, "MS-GLU's g and u, which rebuild x"
    if layer in exact:
        return LeanLinear, "the MS norm's x̂"
    if layer in kept:
        return LeanLinear, "x, which another op keeps anyway"
    if method == "actnn":
        bits, group_size = codes[layer]
        of = "the MS norm's x̂, shared" if layer in sharing else "x"
        return InputCodes(bits, group_size), f"{bits}-bit codes of {of}"
    return LeanLinear, "x"


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


def match(model, policy, inputs=None) -> tuple[dict, list, dict]:
    """({name: (module, first matching rule)} for modules a rule applies to (not `keep`),
    [(name, class, why) for modules that match but cannot be replaced], {name: (head name,
    edits)} for the causal LMs whose fused loss is planned, on `inputs` where given).

    A gated MLP or a causal LM's head that its rule refuses is reported, and its parts are
    matched by the other rules in the same pass: a second compress finds nothing to do. A
    block recomputed leaves its parts to their own rules; a block inside one is refused (it
    would be recomputed twice over)."""
    chosen, skipped, planned = {}, [], {}
    modules = dict(model.named_modules())
    recomputed = []  # the blocks recomputed, now or by an earlier compress
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
            skipped.append((name, type(m).__name__, why))
            owners.append(name)
            continue
        if is_lora_linear(m):
            owners.append(name)
            if isinstance(m.__dict__.get("forward"), LeanLoRA):
                continue  # lean already
        target = target_of(m, modules.get(name.rpartition(".")[0]) if name else None)
        if target is None or id(m) in heads:
            continue
        if target == "block" and is_checkpoint_forward(m.__dict__.get("forward")):
            recomputed.append(name)
            continue  # recomputed already; its parts are matched below
        if target == "head" and isinstance(m.get_output_embeddings(), FusedLossHead):
            continue  # fused already
        rule = _first_rule(policy, name, m, target)
        if rule is None or rule.apply == "keep":
            continue
        outer = next((b for b in recomputed if name.startswith(b + ".")), None)
        if rule.apply == "checkpoint" and outer is not None:
            skipped.append((name, type(m).__name__, f"inside {outer}, which is recomputed "
                            "already"))
            continue
        if not name and target != "head":
            skipped.append(("(model)", type(m).__name__, "compress replaces submodules: "
                            "wrap the module in a container"))
            continue
        try:  # a composite refused releases its parts to the other rules
            if rule.apply == "msglu":
                MSGLU.from_module(m)
            elif rule.apply == "fused_ce":
                planned[name] = plan_fused_loss(m, rule.option("chunk_size"),
                                                _with_labels(inputs))
        except ActdesignError as exc:
            skipped.append((name or "(model)", type(m).__name__, str(exc)))
            continue
        chosen[name] = (m, rule)
        if rule.apply == "checkpoint":
            recomputed.append(name)
        if target == "glu":
            glus.add(name)
            owners.append(name)
        if target == "head" and type(m.get_output_embeddings()) is nn.Linear:
            heads.add(id(m.get_output_embeddings()))
    return chosen, skipped, planned


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


def _ours(m) -> bool:
    """A module a compress made, or gave a forward of ours."""
    forward = m.__dict__.get("forward")
    return type(m).__module__.startswith(("actdesign.", "actdesign_ops_")) \
        or isinstance(forward, LeanLoRA) or is_rotary_forward(forward) \
        or is_checkpoint_forward(forward)


def _first_rule(policy, name, m, target):
    """The first rule of `policy` for module `m` of kind `target` at `name`, or None."""
    return next((rule for rule in policy.rules
                 if rule.target == target and any(fnmatchcase(name, g) for g in rule.names)
                 and (not rule.types or type(m).__name__ in rule.types)), None)


def _actnn_layers(chosen, policy) -> dict:
    """{Linear: (bits, group size)} for the Linear layers an ActNN rule claims: the chosen
    ones, and the layers of chosen gated MLPs that a rule would claim on their own."""
    out = {}
    for name, (m, rule) in chosen.items():
        if rule.apply == "actnn" and not isinstance(m, nn.Conv2d):
            out[m] = _actnn_bits(name, rule)
        elif rule.apply == "msglu":
            for part in ("gate_proj", "up_proj", "down_proj"):
                layer, qualified = getattr(m, part), f"{name}.{part}"
                own = _first_rule(policy, qualified, layer, "linear")
                if own is not None and own.apply == "actnn":
                    out[layer] = _actnn_bits(qualified, own)
    return out


def _actnn_bits(name, rule) -> tuple[int, int]:
    """(bits, group size) of an ActNN rule for the layer at `name`."""
    bits = rule.option("bits")
    if rule.option("allocation"):
        bits = load_bits(rule.option("allocation")).get(name, bits)
    return bits, rule.option("group_size")


def _probe_inputs(model, example_inputs):
    if example_inputs is None and models.transformers_model(model) is not None:
        example_inputs = models.example_batch(model, batch=2, seq=8)
    return example_inputs


def _with_labels(inputs):
    """The probe inputs of a causal LM with labels (its own, or the input ids), or None."""
    if not isinstance(inputs, dict) or "input_ids" not in inputs:
        return None
    return {"labels": inputs["input_ids"], **inputs}


def _share_norms(model, policy, norms: dict, run, report, codes: dict, names: dict):
    """MS norms for the norms they can replace, sharing their parameters: (replacements, the
    layers reading a norm that keeps x̂, those reading a norm that keeps codes of x̂ (when every
    reader is an ActNN layer of one bit width, in `codes`), every such reader). A norm with
    an affine is replaced where the probe shows that only Linear layers read its output, none
    of them kept as it is by the policy; the rest are reported. `names` maps modules to
    their names."""
    new, exact, sharing, readers, ms = {}, set(), set(), [], {}
    for name, m in norms.items():  # what no MS norm computes is refused first
        try:
            ms[name] = ms_norm(m)
        except ActdesignError as exc:
            report.skipped.append((name, type(m).__name__, str(exc)))
    plain = {n: m for n, m in norms.items() if n in ms and _affine_free(ms[n])}
    affine = {n: m for n, m in norms.items() if n in ms and n not in plain}
    if affine and run is None:
        for name, m in affine.items():
            report.skipped.append((name, type(m).__name__, "sharing its x̂ with the layers "
                                   "reading it needs example_inputs, to see which they are"))
        affine = {}
    uses = norm_consumers(model, affine, run) if affine else {}
    for name, m in {**plain, **affine}.items():
        found = [] if name in plain else uses[name]
        if isinstance(found, list):
            kept = [names[r] for r in found if _kept_by_policy(policy, names[r], r)]
            if kept:
                found = f"{kept[0]}, reading it, is kept as it is by the policy"
        if isinstance(found, str):
            report.skipped.append((name, type(m).__name__, found))
            continue
        new[m] = ms[name]
        layouts = {codes.get(r) for r in found}
        what = type(new[m]).__name__
        if found and len(layouts) == 1 and None not in layouts:
            bits, group_size = layouts.pop()
            new[m] = _QMSNorm.from_norm(new[m], bits=bits, group_size=group_size)
            what = f"{type(new[m]).__name__} ({bits}-bit codes of x̂"
            sharing.update(found)
        else:
            what += " (keeps rstd and x̂, or its output where that is 16-bit"
            exact.update(found)
        readers += found
        into = f", shared with {', '.join(names[r] for r in found)}" if found else ""
        report.replaced.append(Change(name, type(m).__name__, what + into + ")"))
    return new, exact, sharing, readers


def _kept_by_policy(policy, name, layer) -> bool:
    rule = _first_rule(policy, name, layer, "linear")
    return rule is not None and rule.apply == "keep"


def _affine_free(norm) -> bool:
    return getattr(norm, "weight", None) is None and getattr(norm, "bias", None) is None


def _replacement(name, m, rule, codes, sharing) -> tuple[nn.Module, str]:
    """The module replacing `m` under `rule`, and what it is in words. `codes` and `sharing`
    (from `_actnn_layers` and `_share_norms`) say which Linear layers ActNN quantizes, and
    which of them read a norm's codes."""
    opts = dict(rule.options)
    if rule.apply in ("fewbit", "pwl"):
        spec = _spec_for(m, rule.apply, opts)
        kind = "piecewise-linear" if spec.kind == "pwl" else "stepwise"
        return load(spec).Module(), f"{spec.activation.get('name') or 'expression'} " \
                                    f"{spec.bits}-bit {kind} table"
    conv = isinstance(m, nn.Conv2d)
    if rule.apply == "actnn":
        cls = QConv2d if conv else QLinear
        bits, group_size = _actnn_bits(name, rule)
        new = cls.from_module(m, bits=bits, group_size=group_size)
        shared = ": the MS norm's codes, shared" if m in sharing else ""
        return new, f"{cls.__name__} ({bits}-bit saved input{shared})"
    if rule.apply == "backrazor":
        cls = SparseConv2d if conv else SparseLinear
        new = cls.from_module(m, ratio=opts["ratio"], int8=opts["int8"])
        kept = f"top {1 - opts['ratio']:.0%}" + (", int8" if opts["int8"] else "")
        return new, f"{cls.__name__} ({kept} of the input saved)"
    if rule.apply == "pooled":
        return PooledConv2d.from_module(m, p=opts["pool"]), \
            f"PooledConv2d (input pooled {opts['pool']}x{opts['pool']})"
    if rule.apply == "lean":
        return LeanLinear.from_module(m), "LeanLinear (no 16-bit weight copy kept)"
    if rule.apply == "msact":
        return MSActivation.from_module(m), "MSActivation (keeps its input only, which its " \
            "reader shares; one kernel each way for 16-bit inputs on CUDA)"
    if rule.apply == "msglu":
        reads_codes = m.gate_proj in sharing and m.up_proj in sharing
        new = MSGLU.from_module(m, codes=_up_codes(codes.get(m.down_proj)),
                                input_codes=codes[m.gate_proj] if reads_codes else None,
                                tile=opts["tile"])
        kept = "up(x)" if new.bits is None else f"{new.bits}-bit codes of up(x)"
        inputs = f"; gate and up keep the MS norm's {new.input_codes[0]}-bit codes of x" \
            if reads_codes else ""
        if new.tile is not None:
            tiles = "tiles of as many tokens as its width" if new.tile == "auto" \
                else f"tiles of {new.tile} tokens"
            return new, f"MSGLU ({new.act}; in sequence {tiles}, keeping its input only)"
        return new, f"MSGLU ({new.act}; keeps gate(x) and {kept} only{inputs})"
    raise AssertionError(rule.apply)


def _up_codes(down):
    """MS-GLU's codes of up(x), given the down projection's ActNN (bits, group size): two bits
    more, at most 8. û enters the input gradient elementwise, dg = dh·û·act'(g), where a
    norm's codes enter only through a row mean: at 2 bits the rounding noise is about half of
    the MLP's input gradient, at 4 bits (a step 5 times finer) about a tenth; a norm's 2-bit
    codes add about a tenth at d = 128 and a twentieth at d = 768 (tests/test_shared_codes.py;
    the LLaMA convergence in benchmarks/RESULTS.md)."""
    return None if down is None else (min(8, down[0] + 2), down[1])


def _spec_for(m, method: str, opts: dict) -> spec_mod.Spec:
    """The table for an activation module: the rule's spec, or the built-in one for its own
    activation; refused when it is for another activation or the other kind."""
    own = activation_name(m)
    if own is None and not has_builtin(m):
        trained = ", with trainable parameters," if any(True for _ in m.parameters()) else ""
        raise ActdesignError(f"{type(m).__name__}{trained} computes no built-in activation, "
                             "which the tables are fitted for")
    if own is None:
        raise ActdesignError(f"its settings ({m.extra_repr() or 'none'}) match no built-in "
                             "activation")
    kind = "pwl" if method == "pwl" else "stepwise"
    given = opts["spec"]
    if given is None:
        return table(kind, own, opts["bits"])
    if isinstance(given, str) and policy_mod.table_name(given) is not None:
        kind_given, act, bits = policy_mod.table_name(given)
        spec = table(kind_given, resolve(act).name, bits)
    else:
        spec = spec_mod.load(given)
    named = spec.activation.get("name")
    if named is None or resolve(named).name != own:
        raise ActdesignError(f"its spec is for {named or spec.activation.get('expr')!r}, but "
                             f"the module computes {own}")
    if spec.kind != kind:
        raise ActdesignError(f"'{method}' needs a {kind} spec, got a {spec.kind} one")
    return spec


def _swaps(model, new: dict) -> list[Edit]:
    """The edits putting each replacement wherever its module appears (shared modules too)."""
    edits = []
    for name, m in model.named_modules(remove_duplicate=False):
        if m in new:
            parent, _, attr = name.rpartition(".")
            edits.append(Edit(model.get_submodule(parent), attr, new[m]))
    return edits
