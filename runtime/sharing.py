"""What a tensor's producer offers the layers that read it, so that they keep less.

An MS norm's output is y = x̂·γ + β, and the norm keeps x̂ for its own backward. A layer
reading y needs y only for its weight gradient: instead of y it keeps a reference to that same
x̂, with γ and β (parameters the model holds anyway), and rebuilds y in its backward with the
norm's own `affine`, bit for bit. So x̂ is stored once for the norm and all its readers, and
the norm keeps its parameters: nothing is folded, nothing is reparametrised.

The offer is an attribute of y, valid while y is unchanged (its version counter). A reader
may hold a view of every element of y (transformers slices `h[:, 0:]` before the head, and a
loss flattens it). Under torch.compile nothing is offered: the compiler decides what to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actdesign.codegen.render import render_norms

from .cache import generated

_NORM_OUTPUT = "_actdesign_norm_output"


@dataclass(frozen=True)
class _Affine:
    xhat: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    version: int


def whole(x):
    """The tensor of which x is a view of every element in the same layout (as `h[:, 0:]`
    is: transformers slices the hidden states before the head), or x itself."""
    base = x._base
    if base is not None and (x.shape, x.stride(), x.storage_offset()) == (
            base.shape, base.stride(), base.storage_offset()):
        return base
    return x


def _covered(x):
    """The tensor x covers element for element in the same order, rows intact (x itself, or
    a contiguous view of a contiguous base with the same rows, flattened or sliced whole)."""
    base = x._base
    if base is not None and x.is_contiguous() and base.is_contiguous() \
            and x.numel() == base.numel() and x.storage_offset() == base.storage_offset() \
            and x.dim() and base.dim() and x.shape[-1] == base.shape[-1]:
        return base
    return x


def offer(y, xhat, weight, bias) -> None:
    """Tell the readers of y = affine(x̂, weight, bias) that they may keep x̂ instead."""
    if torch.compiler.is_compiling():
        return
    setattr(y, _NORM_OUTPUT, _Affine(xhat, weight, bias, y._version))


def kept_for(x):
    """(the tensor to keep for x, (weight, bias) to rebuild x from it with `rebuild`, or None
    when the tensor is x itself)."""
    if torch.compiler.is_compiling():
        return x, None
    base = _covered(x)
    got = getattr(base, _NORM_OUTPUT, None)
    if got is None or got.version != base._version:
        return x, None
    return (got.xhat if x is base else got.xhat.view(x.shape)), (got.weight, got.bias)


def rebuild(kept, affine, dtype):
    """x from what `kept_for` gave: the norm's affine of x̂, in x's dtype; or x itself."""
    if affine is None:
        return kept
    return generated(render_norms).affine(kept, *affine, dtype)
