"""`lean`: a Linear or Conv2d layer, exact, keeps its input and the weight itself for the
backward, never a 16-bit copy of the weight (`ops.compressed.LeanLinear`, `LeanConv2d`), and
reads its input from what its producer keeps where it offers it (an MS norm's x̂, a conv
chain's recipe); a PEFT LoRA layer gets the lean LoRA path. The default for the layers no
other preset claims."""

from __future__ import annotations

from torch import nn

from ..ops.compressed import LeanConv2d, LeanLinear
from .base import Method, register
from .lora import is_lean, lean_lora


@register
class Lean(Method):
    name = "lean"
    targets = ("linear", "conv2d")
    family = "llm"
    fallback = True

    def attached(self, module) -> bool:
        return is_lean(module)

    def replacement(self, name, module, rule, draft):
        cls = LeanConv2d if isinstance(module, nn.Conv2d) else LeanLinear
        return cls.from_module(module), f"{cls.__name__} (no 16-bit weight copy kept)"

    def replace_lora(self, name, layer, rule, draft) -> None:
        lean_lora(name, layer, draft)
