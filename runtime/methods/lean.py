"""`lean`: a Linear layer, exact, keeps its input and the weight itself for the backward,
never a 16-bit copy of the weight (`ops.compressed.LeanLinear`), and reads its input from
what its producer keeps where it offers it; a PEFT LoRA layer gets the lean LoRA path. The
default for the Linear layers no other preset claims."""

from __future__ import annotations

from ..ops.compressed import LeanLinear
from .base import Method, register
from .lora import is_lean, lean_lora


@register
class Lean(Method):
    name = "lean"
    targets = ("linear",)
    family = "llm"
    fallback = True

    def attached(self, module) -> bool:
        return is_lean(module)

    def replacement(self, name, module, rule, draft):
        return LeanLinear.from_module(module), "LeanLinear (no 16-bit weight copy kept)"

    def replace_lora(self, name, layer, rule, draft) -> None:
        lean_lora(name, layer, draft)
