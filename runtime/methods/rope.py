"""An attention module rotating q and k with `ops.rope.rotary`, as an edit."""

from __future__ import annotations

from torch import nn

from actdesign.errors import ActdesignError

from ..ops.known_modules import ROTARY as NAME
from ..ops.known_modules import rotary_function_of
from ..ops.rope import is_standard, rotary_forward
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
