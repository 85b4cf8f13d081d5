"""A block recomputed in the backward (`ops.recompute`), as an edit."""

from __future__ import annotations

from torch import nn

from actdesign.errors import ActdesignError

from ..ops.recompute import recomputed_forward
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
