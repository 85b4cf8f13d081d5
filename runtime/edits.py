"""Assignments on a model that can be taken back: how `compress` applies a plan.

An edit is one assignment: a submodule put in its parent's place, or an attribute (a forward)
set on a module instance. Applying a list either makes every assignment or, when one raises,
takes back those made, so the model is as it was.
"""

from __future__ import annotations

from torch import nn

_MISSING = object()


class Edit:
    """`setattr(owner, name, value)`, remembering what it replaces."""

    def __init__(self, owner: nn.Module, name: str, value):
        self.owner, self.name, self.value = owner, name, value
        self.old = _MISSING

    def apply(self) -> None:
        place = self.owner._modules if isinstance(self.value, nn.Module) else self.owner.__dict__
        self.old = place.get(self.name, _MISSING)
        setattr(self.owner, self.name, self.value)

    def undo(self) -> None:
        if self.old is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.old)

    def __repr__(self):
        return f"Edit({type(self.owner).__name__}.{self.name} = {type(self.value).__name__})"


def apply_all(edits) -> None:
    """Apply every edit in order; if one raises, undo those applied and raise."""
    done = []
    try:
        for edit in edits:
            edit.apply()
            done.append(edit)
    except BaseException:
        undo_all(done)
        raise


def undo_all(edits) -> None:
    for edit in reversed(list(edits)):
        edit.undo()
