"""`rope`: an attention module rotates q and k with `ops.rope.rotary`: one kernel for both
each way on CUDA, in the dtype attention reads, so no float32 temporaries under autocast;
elsewhere eager's own ops, as before. Exact. The module stays; its forward is replaced on the
instance by a copy of its class's that calls the rotation."""

from __future__ import annotations

from torch import nn

from actdesign.errors import ActdesignError

from ..ops.known_modules import ROTARY as NAME
from ..ops.known_modules import rotary_function_of
from ..ops.rope import is_rotary_forward, is_standard, rotary_forward
from .base import Method, register
from .edits import BoundMethod, Edit


def plan_rotary(attention: nn.Module) -> Edit:
    """The edit that makes this attention module rotate q and k with `rotary` (nothing is
    changed here). Refused when its forward does not call a standard apply_rotary_pos_emb."""
    original = rotary_function_of(attention)
    if original is None:
        raise ActdesignError(f"its forward does not call {NAME} from its modeling file")
    if not is_standard(original):
        raise ActdesignError(f"its {NAME} is not the standard rotation (rotate_half of the "
                             "two halves), checked on a probe")
    if "forward" in attention.__dict__:
        raise ActdesignError("its forward is already replaced on the instance")
    # A method bound to the instance: the class forward's signature and docstring; a deep
    # copy of the model binds the copy, and a pickled one makes the forward again.
    return Edit(attention, "forward", BoundMethod(attention, rotary_forward, type(attention),
                                                  original))


def attach_rotary(attention: nn.Module) -> None:
    """Make this attention module rotate q and k with `rotary` (see `plan_rotary`)."""
    plan_rotary(attention).apply()


@register
class Rope(Method):
    name = "rope"
    targets = ("attention",)
    family = "llm"

    def attached(self, module) -> bool:
        return is_rotary_forward(module.__dict__.get("forward"))

    def replace(self, name, module, rule, draft) -> None:
        draft.edits.append(plan_rotary(module))
        draft.said(name, type(module).__name__, _words(module))


def _words(attention) -> str:
    """What rotates q and k where the module's weights are now (`ops.rope.rotary`): one
    kernel for both takes CUDA tensors (in any float dtype, under autocast or not); anywhere
    else eager's own ops run, as before."""
    p = next(attention.parameters(), None)
    device = p.device.type if p is not None else "cpu"
    kernel = "one kernel for q and k each way"
    if device != "cuda":
        return f"rotary embedding: eager's own ops on {device}; {kernel} on CUDA"
    return f"rotary embedding in {kernel}"
