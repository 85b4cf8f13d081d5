"""What a compression method declares, and the registry `compress`, `estimate`, the planner,
its explanations and the CLI read.

A method is one idea (a few-bit table, ActNN's codes, an MS norm, a fused loss, a
recomputed block...) and one module of this package. Its class says:
- `name`, what a policy rule's "apply" names, and `options`, with their defaults and checks;
- `targets`, the kinds of module it applies to (`targets.target_of`);
- how it replaces one module (`replace`, or `replacement` for a plain module swap), and the
  sentence the report prints;
- what it shares with its neighbours: the layers that keep ActNN codes (`codes`), work done
  once before and after the modules (`prepare`, `finish`), a LoRA layer's lean path;
- `offers`, its options the planner prices per kind of site, and `family`, whose
  fragmentation a card's margins use.

`compress` runs the steps on a draft of its plan (`apply.compress.Draft`): the facts one
method leaves for another (which layers read an MS norm's x̂, which inputs another op keeps
anyway) are named there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from actdesign.errors import ActdesignError

from ..ops.compressed import LeanConv2d

# name -> the method, in the order the registering modules are imported (`methods/__init__`)
METHODS: dict[str, Method] = {}


def register(cls):
    """A class decorator: one instance of a Method subclass registered under its name."""
    if cls.name in METHODS:
        raise ValueError(f"a method named {cls.name!r} is registered already")
    METHODS[cls.name] = cls()
    return cls


@dataclass(frozen=True)
class Option:
    """A rule's option: its default, and `check(value, where, base)` returning the value as
    kept (a path made absolute against `base`, the policy file's folder) or raising an
    ActdesignError that starts with `where`."""
    default: object
    check: Callable


def integer(lo: int, hi: int) -> Callable:
    def check(value, where, base=None):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ActdesignError(f"{where} must be an integer in {lo}..{hi}, got {value!r}")
        return value
    return check


def optional(inner: Callable, *allowed) -> Callable:
    """None, one of `allowed` (such as "auto"), or what `inner` accepts."""
    def check(value, where, base=None):
        return value if value is None or value in allowed else inner(value, where, base)
    return check


def boolean(value, where, base=None):
    if not isinstance(value, bool):
        raise ActdesignError(f"{where} must be true or false, got {value!r}")
    return value


def option_label(method: str, options: dict) -> str:
    """How a table names a method at one value of its option: actnn2, backrazor0.9."""
    if not options:
        return method
    return f"{method}{next(iter(options.values())):g}"


class Method:
    """One compression method. Subclasses set the class attributes and override the steps
    they take part in; every step but `replace` does nothing by default."""

    name: str  # what a policy rule's "apply" says
    targets: tuple[str, ...] = ()  # the target kinds it applies to
    options: dict[str, Option] = {}
    family = "eager"  # a card's margins: eager, llm (lossless ops) or checkpointing
    fallback = False  # in presets joined by '+', its rules come last (the default for the rest)
    # it keeps a compressed copy of a convolution's input: where another op keeps that input
    # whole anyway, the copy would add bytes, and the convolution stays exact and lean instead
    copies_conv_input = False
    # it keeps codes in place of what an activation keeps for its backward: where another op
    # keeps that tensor whole anyway (a convolution reading a ReLU's output), the codes would
    # add bytes, and the activation is left as it is
    codes_what_it_keeps = False
    offers: dict[str, tuple[dict, ...]] = {}  # the planner's options: site kind -> values

    # --- matching ----------------------------------------------------------------------
    def attached(self, module) -> bool:
        """Whether `module` runs a forward this method set on the instance."""
        return False

    def made(self, module) -> bool:
        """Whether an earlier compress applied this method to `module`, which is then not
        matched again."""
        return self.attached(module)

    def check(self, name, module, rule, draft) -> None:
        """At matching: raise an ActdesignError to leave a composite module (a gated MLP, a
        causal LM and its head) to the other rules, its parts matched by them."""

    def takes(self, module) -> bool:
        """Whether the planner may offer this method for `module` (a site of its kind)."""
        return True

    def sites(self, name, module) -> dict[str, str]:
        """{part's name: site kind}: the planner's sites inside a module this method takes
        whole (a gated MLP's projections)."""
        return {}

    # --- planning -----------------------------------------------------------------------
    def codes(self, name, module, rule, draft) -> dict:
        """{Linear layer: (bits, group size)} for the layers that keep ActNN codes of their
        input under this rule (a norm whose readers all do keeps codes of its x̂ for them)."""
        return {}

    def prepare(self, chosen: dict, draft) -> None:
        """Once, before any module is replaced: `chosen` maps names to (module, rule) for
        the modules this method was chosen for."""

    def replace(self, name, module, rule, draft) -> None:
        """Plan one module: a swap (`draft.swap`) or edits (`draft.edits`), each said in
        the report (`draft.said`). An ActdesignError leaves the module alone, its message
        the reason the report gives."""
        if self.codes_what_it_keeps and module in draft.kept:
            raise ActdesignError("what it keeps for its backward another op keeps whole anyway "
                                 "(the layer reading it): codes of it would add bytes, not "
                                 "free them")
        if self.copies_conv_input and isinstance(module, nn.Conv2d) and module in draft.kept:
            draft.swap(name, module, LeanConv2d.from_module(module),
                       "LeanConv2d (its input is kept whole by another op anyway: a copy "
                       "would add bytes, not free them)")
            return
        new, words = self.replacement(name, module, rule, draft)
        draft.swap(name, module, new, words)

    def replacement(self, name, module, rule, draft):
        """(the module replacing `module`, what it is in words)."""
        raise NotImplementedError(self.name)

    def replace_lora(self, name, layer, rule, draft) -> None:
        """Plan a PEFT LoRA layer (`lora.plan_lean_lora`); by default it is left alone."""
        takes = [repr(m.name) for m in METHODS.values()
                 if type(m).replace_lora is not Method.replace_lora]
        raise ActdesignError(f"a LoRA layer takes {' or '.join(takes)}, not {self.name!r}")

    def finish(self, draft) -> None:
        """Once, after every module is planned."""

    # --- the planner --------------------------------------------------------------------
    def label(self, rule) -> str | None:
        """The planner's name for a rule of this method, as its options are offered
        (fewbit3, actnn2); None where the planner offers it nowhere."""
        offered = next(iter(self.offers.values()), None)
        if not offered:
            return None
        return option_label(self.name, {k: rule.option(k) for k in offered[0]})
