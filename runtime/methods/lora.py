"""A PEFT LoRA layer given the lean forward of `ops.lora`, as edits."""

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
