"""The planner's sites and options: where a lossy method can act (an activation, or the
layers reading one tensor), the blocks a checkpoint rule can name, each kind's options, and
the policy a choice of options makes."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ... import models
from ...apply import policy as policy_mod
from ...apply.compress import match
from ...methods import METHODS, option_label
from ...methods.checkpoint import Checkpoint
from ...methods.targets import target_of
from ...ops.draws import probing
from ...ops.sharing import whole

LOSSLESS = "llm"


def kinds() -> list[str]:
    """The kinds of site some method is offered for, in the registry's order."""
    return list(dict.fromkeys(kind for method in METHODS.values() for kind in method.offers))


def options(kind: str) -> list[tuple[str, dict]]:
    """A site kind's options after `keep`, as (method, options): every registered method's
    offers for it, in the registry's order."""
    return [(method.name, dict(o)) for method in METHODS.values()
            for o in method.offers.get(kind, ())]


@dataclass(frozen=True)
class Site:
    name: str  # how the table names it
    kind: str  # activation, linear or conv2d
    layers: tuple[str, ...]  # the modules a rule names
    block: str | None  # the block it lies in


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
        *({"target": kind, "apply": options(kind)[0][0]} for kind in kinds()),
        *policy_mod.PRESETS[LOSSLESS]]}
    layers = {}  # name -> kind
    for name, (m, rule) in match(model, policy_mod.load(every)).chosen.items():
        method = METHODS[rule.apply]
        if rule.target in method.offers and method.takes(m):
            layers[name] = rule.target
        layers |= method.sites(name, m)  # the parts of a module a method takes whole
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
    from ...apply.accounting import storage_key

    seen = {}

    def hook(name):
        def record(module, args):
            seen.setdefault(name, whole(args[0]))  # held: no storage is reused meanwhile
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        with torch.no_grad(), probing(model):
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
    return {option_label(m, o): (m, o) for m, o in options(kind)}


def site_rules(site: Site, method: str, options: dict) -> list[dict]:
    return [{"target": site.kind, "name": list(site.layers), "apply": method, **options}]


def policy_of(rules: list[dict], label="plan") -> policy_mod.Policy:
    base = policy_mod.PRESETS[LOSSLESS]
    return policy_mod.validate({"format": policy_mod.FORMAT, "rules": [*rules, *base]},
                               label=label)


def checkpoint_rules(blocks, offloaded=()) -> list[dict]:
    """Rules recomputing `blocks`, those also in `offloaded` with their inputs on the host."""
    moved = [b for b in blocks if b in offloaded]
    kept = [b for b in blocks if b not in offloaded]
    rules = []
    if moved:
        rules.append({"target": "block", "name": moved, "apply": Checkpoint.name,
                      "offload": True})
    if kept:
        rules.append({"target": "block", "name": kept, "apply": Checkpoint.name})
    return rules


def plan_policy(costs, solution) -> policy_mod.Policy:
    """The policy of a solution of `costs.problem`: its sites' choices, its blocks recomputed
    (offloaded where it says)."""
    rules = []
    for i, (site, c) in enumerate(zip(costs.sites, solution.choice, strict=True)):
        if c:
            method, opts = labelled(site.kind)[costs.problem.sites[i].options[c].name]
            rules += site_rules(site, method, opts)
    rules += checkpoint_rules(
        [b for b, on in zip(costs.blocks, solution.recomputed, strict=True) if on],
        {b for b, on in zip(costs.blocks, solution.offloaded, strict=True) if on})
    return policy_of(rules)


PRESETS = ("llm", "llm+actnn2", "fewbit3+msnorm", "fewbit3+msnorm+actnn2", "actnn2",
           "llm+checkpoint")


def preset_policy(costs, name: str) -> policy_mod.Policy:
    """A preset, or `llm+checkpoint`: llm with every block recomputed."""
    if name == "llm+checkpoint":
        return policy_of(checkpoint_rules(costs.blocks), label=name)
    return policy_mod.load(name)
