"""A PEFT LoRA layer given the lean forward of `ops.lora`, as edits: what the `lean` and
`actnn` rules do to a LoRA layer, and what an MS norm does to one reading it."""

from __future__ import annotations

from torch import nn

from ..ops.compressed import LeanLinear
from ..ops.known_modules import is_hf_conv1d
from ..ops.lora import LeanLoRA
from .edits import Edit


def plan_lora(layer: nn.Module, keeper=LeanLinear) -> list[Edit]:
    """The edits giving a PEFT LoRA layer (`targets.is_lora_linear`) the lean forward: its
    base layer, when an nn.Linear or a transformers Conv1D, becomes a LeanLinear holding the
    same parameters (frozen, it keeps nothing); any other base (a quantized one) stays and is
    called as it is. Nothing is changed here."""
    edits = []
    base = layer.base_layer
    if type(base) is nn.Linear or is_hf_conv1d(base):
        edits.append(Edit(layer, "base_layer", LeanLinear.from_module(base)))
    return edits + [Edit(layer, "forward", LeanLoRA(layer, keeper))]


def is_lean(module) -> bool:
    """Whether a LoRA layer has the lean forward already."""
    return isinstance(module.__dict__.get("forward"), LeanLoRA)


def kept_elsewhere(layer, draft) -> str | None:
    """What keeps a LoRA layer's input anyway, in words, where something does: its
    producer rebuilding it, an MS norm's x̂, or another op."""
    if layer in draft.rebuilt:
        return draft.rebuilt[layer]
    if layer in draft.exact:
        return "the MS norm's x̂"
    if layer in draft.kept:
        return "x, which another op keeps anyway"
    return None


def plan_lean_lora(name, layer, keeper, kept, draft) -> None:
    """Plan a LoRA layer's lean forward, keeping x for A's gradient as `keeper` says (`kept`:
    that in words)."""
    draft.said(name, "lora.Linear", f"lean LoRA (the frozen base keeps nothing; the adapter "
                                     f"keeps A·drop(x) and {kept}; the dropout mask is "
                                     "replayed)")
    draft.edits += plan_lora(layer, keeper)


def lean_lora(name, layer, draft) -> None:
    """The lean forward keeping x exactly: what keeps it anyway where something does."""
    plan_lean_lora(name, layer, LeanLinear, kept_elsewhere(layer, draft) or "x", draft)
