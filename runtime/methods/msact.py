"""`msact`: an activation outside a gated MLP (GPT-2's gelu_new) keeps its input only, which
the layer reading its output shares, in one kernel each way (`ops.msact`). Exact: the default
for the activations no other preset claims."""

from __future__ import annotations

from ..ops.msact import MSActivation
from .base import Method, register


@register
class MSAct(Method):
    name = "msact"
    targets = ("activation",)
    family = "llm"
    fallback = True

    def replacement(self, name, module, rule, draft):
        return MSActivation.from_module(module), "MSActivation (keeps its input only, which " \
            "its reader shares; one kernel each way for 16-bit inputs on CUDA)"
