"""Assignments on a model that can be taken back: how `compress` applies a plan.

An edit is one assignment: a submodule put in its parent's place, or an attribute (a forward)
set on a module instance. Applying a list either makes every assignment or, when one raises,
takes back those made, so the model is as it was.
"""

from __future__ import annotations

import types

from torch import nn

_MISSING = object()


class BoundMethod:
    """`make(*args)`, a function, bound to `owner` as a method set on the instance: a deep
    copy binds the copy, and a pickle holds (owner, make, args), so that a function built at
    run time (a copy with other globals, a wrapper) is built again where it is loaded. `make`
    and `args` must pickle by reference (module-level functions, classes)."""

    def __init__(self, owner, make, *args):
        self.__self__, self._make, self._args = owner, make, args
        self.__func__ = make(*args)
        self.__name__, self.__qualname__ = self.__func__.__name__, self.__func__.__qualname__
        self.__doc__ = self.__func__.__doc__

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __wrapped__(self):
        """The plain bound method: inspect.signature reads its signature through this."""
        return types.MethodType(self.__func__, self.__self__)

    def __reduce__(self):
        return BoundMethod, (self.__self__, self._make, *self._args)

    def __repr__(self):
        return f"<bound method {self.__qualname__} of {type(self.__self__).__name__}>"


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
