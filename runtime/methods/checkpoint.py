"""`checkpoint`: a block (a layer of a model's layer list, a CNN's stage) is recomputed in
the backward, keeping only its inputs (`ops.recompute`); with `"offload": true` they wait
in host memory (`ops.offload`). Exact. The modules inside are compressed by their own rules;
a block inside one recomputed is refused (it would be recomputed twice over)."""

from __future__ import annotations

from torch import nn

from actdesign.errors import ActdesignError

from ..ops.recompute import is_checkpoint_forward, recomputed_forward
from .base import Method, Option, boolean, register
from .edits import BoundMethod, Edit


def plan_checkpoint(block: nn.Module, offload: bool = False) -> Edit:
    """The edit that makes `block` recompute its forward in the backward, its inputs kept in
    host memory with `offload` (nothing is changed here). Refused where transformers
    checkpoints it already, or where its forward is already replaced on the instance."""
    if getattr(block, "gradient_checkpointing", False) is True:
        raise ActdesignError("transformers checkpoints it already (gradient checkpointing is "
                             "on): turn that off to name the layers recomputed")
    if "forward" in block.__dict__:
        raise ActdesignError("its forward is already replaced on the instance")
    return Edit(block, "forward", BoundMethod(block, recomputed_forward, type(block), offload))


@register
class Checkpoint(Method):
    name = "checkpoint"
    targets = ("block",)
    options = {"offload": Option(False, boolean)}
    family = "checkpointing"

    def attached(self, module) -> bool:
        return is_checkpoint_forward(module.__dict__.get("forward"))

    def check(self, name, module, rule, draft) -> None:
        recomputed = [n for n, method in draft.made.items() if method == self.name] + [
            n for n, (_, r) in draft.chosen.items() if r.apply == self.name]
        outer = next((b for b in recomputed if name.startswith(b + ".")), None)
        if outer is not None:
            raise ActdesignError(f"inside {outer}, which is recomputed already")

    def replace(self, name, module, rule, draft) -> None:
        offload = rule.option("offload")
        draft.edits.append(plan_checkpoint(module, offload))
        draft.said(name, type(module).__name__, "recomputed in backward (checkpoint"
                   + (", its input kept in host memory)" if offload else ")"))
