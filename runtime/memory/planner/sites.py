"""The planner's sites and options: where a lossy method can act (an activation, the layers
reading one tensor, or a convolutional chain's codes), the blocks a checkpoint rule can name,
each kind's options, and the policy a choice of options makes."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch

from ... import models
from ...apply import policy as policy_mod
from ...apply.accounting import storage_key
from ...apply.compress import compress, match
from ...methods import METHODS, option_label
from ...methods.checkpoint import Checkpoint
from ...methods.targets import target_of
from ...ops.draws import probing
from ...ops.sharing import kept_for, whole

LOSSLESS = "llm"  # the lossless base of text models
# The lossless presets a plan may build on: the one keeping the fewest bytes at the target
# shape (MS norms and gated MLPs for transformers, convolutional chains for conv nets).
BASES = ("llm", "cnn")
# Where a chain's norm keeps codes, the activations after it keep what passes its recipe on
# (a ReLU's exact 1-bit mask), as in `actnn2`.
_CHAIN_ACTIVATIONS = next(r for r in policy_mod.PRESETS["actnn2"] if r["target"] == "activation")


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
    kind: str  # activation, linear, conv2d or channel_norm
    layers: tuple[str, ...]  # the modules a rule names
    block: str | None  # the block it lies in
    # A chain's norms and activations, ((name, target), ...), whose codes and masks the
    # layers rebuild their input from: they take the layers' bits where the method keeps
    # codes of a norm (one set of codes serves them all, so one choice of bits).
    sources: tuple[tuple[str, str], ...] = ()


def blocks_of(model) -> list[str]:
    """The blocks: the modules a `checkpoint` rule can name."""
    modules, found = dict(model.named_modules()), []
    for name, m in modules.items():
        parent = modules.get(name.rpartition(".")[0]) if name else None
        outer = any(name.startswith(b + ".") for b in found)
        if name and not outer and target_of(m, parent) == "block":
            found.append(name)
    return found


def find_sites(model, example, base: str = LOSSLESS) -> list[Site]:
    """Every site a lossy rule can take, in the model's order: the activations with a built-in
    derivative and the Linear/Conv layers compress would quantize, grouped by the tensor they
    read, and the batch norms keeping codes, joined with the activations and layers reading
    them (found by forwards of `example`)."""
    every = {"format": policy_mod.FORMAT, "rules": [
        *({"target": kind, "apply": options(kind)[0][0]} for kind in kinds()),
        *policy_mod.PRESETS[base]]}
    layers = {}  # name -> kind
    for name, (m, rule) in match(model, policy_mod.load(every)).chosen.items():
        method = METHODS[rule.apply]
        if rule.target in method.offers and method.takes(m):
            layers[name] = rule.target
        layers |= method.sites(name, m)  # the parts of a module a method takes whole
    modules = dict(model.named_modules())
    reads = _inputs_read(model, {n: modules[n] for n in layers}, example)
    chained = _chains(model, base, layers, example) if "channel_norm" in layers.values() else []
    joined = {n: i for i, chain in enumerate(chained) for n in chain}
    groups: dict = {}
    for name, kind in layers.items():
        key = ("chain", joined[name]) if name in joined else \
            (kind, reads.get(name, name)) if kind != "activation" else (kind, name)
        groups.setdefault(key, []).append(name)
    blocks = blocks_of(model)
    order = {name: i for i, name in enumerate(modules)}
    sites = []
    for (kind, _), names in groups.items():
        names.sort(key=order.get)
        sources = ()
        if kind == "chain":  # the readers name it; the norms alone where none reads it
            readers = [n for n in names if layers[n] in ("conv2d", "linear")]
            norms = [n for n in names if layers[n] == "channel_norm"]
            kind = layers[readers[0]] if readers else "channel_norm"
            sources = tuple((n, layers[n]) for n in names if n not in (readers or norms))
            names = readers or norms
        everything = sorted([*names, *(n for n, _ in sources)], key=order.get)
        inside = {next((b for b in blocks if n.startswith(b + ".")), None) for n in everything}
        block = inside.pop() if len(inside) == 1 else None
        sites.append(Site(_group_name(everything), kind, tuple(names), block, sources))
    sites.sort(key=lambda s: order[s.layers[0]])
    return sites


def _chains(model, base, layers: dict, example) -> list[set]:
    """The layers ActNN's codes join in a convolutional chain: under `base`+actnn2, a batch
    norm's codes, the masks of the activations after it (a residual add joins two chains'),
    and the layers that rebuild their input from them rather than keep codes of their own.
    Found on one forward of a compressed copy."""
    trial = copy.deepcopy(model).train()
    compress(trial, f"{base}+actnn2", allow_more=True)  # a probe of the joined methods
    params = {storage_key(t) for t in [*trial.parameters(), *trial.buffers()]}
    owner, parent = {}, {n: n for n in layers}

    def find(n):
        while parent[n] != n:
            parent[n] = n = parent[parent[n]]
        return n

    def join(name, extras, make):
        if getattr(make, "bits", None) is None:
            return  # nothing offered, or an exact recipe: no codes to share
        for t in extras:
            key = storage_key(t)
            if key not in params:
                parent[find(owner.setdefault(key, name))] = find(name)

    def made(name):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):
                join(name, *kept_for(out, passing_on=True)[1:])
        return hook

    def read(name):
        def hook(module, args):
            join(name, *kept_for(args[0], getattr(module, "bits_taken", None))[1:])
        return hook

    modules = dict(trial.named_modules())
    handles = [modules[n].register_forward_hook(made(n)) if kind in ("channel_norm", "activation")
               else modules[n].register_forward_pre_hook(read(n))
               for n, kind in layers.items()]
    try:
        with probing(trial):  # gradients on: the chain offers only what a backward reads
            models.call(trial, example)
    finally:
        for h in handles:
            h.remove()
    chains: dict = {}
    for n in layers:
        chains.setdefault(find(n), set()).add(n)
    return [c for c in chains.values() if len(c) > 1 and any(layers[n] == "channel_norm"
                                                               for n in c)]


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
    """The rules of a site's option: its layers', and where the method keeps codes of a
    norm, its chain's norms' at the same bits and its activations' masks."""
    rules = [{"target": site.kind, "name": list(site.layers), "apply": method, **options}]
    if "channel_norm" in METHODS[method].targets:
        for target in ("channel_norm", "activation"):
            names = [n for n, t in site.sources if t == target]
            if names:
                rule = {"target": target, "apply": method, **options} \
                    if target == "channel_norm" else _CHAIN_ACTIVATIONS
                rules.append({**rule, "name": names})
    return rules


def policy_of(rules: list[dict], base: str = LOSSLESS, label="plan") -> policy_mod.Policy:
    """`rules` before the lossless base's."""
    return policy_mod.validate({"format": policy_mod.FORMAT,
                                "rules": [*rules, *policy_mod.PRESETS[base]]}, label=label)


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
    return policy_of(rules, costs.base)


# The presets a plan is shown beside, by its lossless base (`base+checkpoint`: the base with
# every block recomputed).
PRESETS = {"llm": ("llm", "llm+actnn2", "fewbit3+msnorm", "fewbit3+msnorm+actnn2", "actnn2",
                   "llm+checkpoint"),
           "cnn": ("cnn", "cnn+actnn2", "actnn2", "pooled2", "backrazor90", "cnn+checkpoint")}


def preset_policy(costs, name: str) -> policy_mod.Policy:
    """A preset, or `base+checkpoint`: the lossless base with every block recomputed."""
    if name == f"{costs.base}+checkpoint":
        return policy_of(checkpoint_rules(costs.blocks), costs.base, label=name)
    return policy_mod.load(name)
