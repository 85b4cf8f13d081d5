"""What a tensor's producer offers the layers that read it, so that they keep less.

An MS norm's output is y = x̂·γ + β, and in float32 the norm keeps x̂ for its own backward
(where y is rounded to 16 bits from a float32 x̂·γ + β, it keeps y itself and offers
nothing: its readers keep that same y). A layer reading y needs y only for its weight
gradient: instead of y it keeps a reference to that same x̂, with γ and β (parameters the
model holds anyway), and rebuilds y in its backward with the norm's own `affine`, bit for
bit. So x̂ is stored once for the norm and all its readers, and the norm keeps its
parameters: nothing is folded, nothing is reparametrised. MS-GLU offers its product h =
act(g)·u the same way, from the g and u it keeps (a LoRA down projection reads h), and so
may any producer: a recipe that rebuilds y from tensors it keeps anyway.

The offer is an attribute of y, valid while y is unchanged (its version counter). A reader
may hold a view of every element of y (transformers slices `h[:, 0:]` before the head, and a
loss flattens it). Under torch.compile nothing is offered: the compiler decides what to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actdesign.codegen.render import render_norms

from .cache import generated

_OFFER = "_actdesign_offer"


@dataclass(frozen=True)
class _Offer:
    primary: torch.Tensor | None  # kept in y's place, and a reader may compress it (x̂)
    extras: tuple  # kept as they are (γ and β; a gated MLP's g and u)
    make: object  # make(primary, *extras, dtype=...) -> y
    version: int
    chained: bool  # a chain's recipe: made outside checkpoints only (`chains.shares_recipes`)


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


class Whole:
    """A keeper (`keep`) that keeps a tensor, or what its producer offers, whole."""

    @staticmethod
    def compress(x):
        return (x,)

    @staticmethod
    def restore(saved, shape, dtype):
        return saved[0]


def offer(y, primary, extras, make, chained=False) -> None:
    """Tell the readers of y = make(primary, *extras, dtype=y.dtype) that they may keep `primary`
    (or a compressed copy of it) and `extras` instead of y: tensors its producer keeps
    anyway. `make` holds no tensors. `chained`: a chain's recipe (`ops.chains`), which steps
    aside inside a checkpoint, and so was made outside it: a reader there does not take it (a
    recompute under the step's saved-tensor hooks, as estimate and plan run it, does not
    find the one its block's input carried in the forward, and saves fewer tensors)."""
    if torch.compiler.is_compiling():
        return
    setattr(y, _OFFER, _Offer(primary, tuple(extras), make, y._version, chained))


def in_checkpoint() -> bool:
    """Inside torch.utils.checkpoint's forward or its recomputation (non-reentrant, as timm's
    and transformers' checkpointing run)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(
        ("_checkpoint_hook.", "_recomputation_hook."))


def offer_affine(y, xhat, weight, bias) -> None:
    """Tell the readers of y = affine(x̂, weight, bias), an MS norm's output, that they may
    keep x̂ instead."""
    offer(y, xhat, (weight, bias), _affine)


def _affine(xhat, weight, bias, dtype):
    return generated(render_norms).affine(xhat, weight, bias, dtype)


def kept_for(x, bits_taken=None, passing_on=False):
    """(primary, extras, make): what to keep for x. `primary` (x itself, or what its producer
    offers, such as x̂) may be compressed; `extras` are kept as they are; `make` is None when
    primary is x itself. `rebuild` turns them back into x.

    An offer made from codes rebuilds an approximation of x (`make.bits`: the fewest bits of
    its codes): it is taken only by a reader that keeps codes of at most as many bits
    (`bits_taken`), never by an exact one (None), and only where what it may keep for the
    offer alone (`make.loose`, a tensor no producer offered) is no more than its own codes.
    `passing_on`: for a recipe one op further, which keeps nothing: every offer."""
    if torch.compiler.is_compiling():
        return x, (), None
    base = _covered(x)
    got = getattr(base, _OFFER, None)
    if got is None or got.version != base._version or (got.chained and in_checkpoint()):
        return x, (), None
    bits = getattr(got.make, "bits", None)
    if bits is not None and not passing_on and (
            bits_taken is None or bits < bits_taken or got.make.loose * 8 > x.numel() * bits_taken):
        return x, (), None
    primary = got.primary
    if primary is not None and x is not base:
        primary = primary.view(x.shape)
    return primary, got.extras, got.make


def rebuild(primary, extras, make, shape, dtype):
    """x, of `shape` and `dtype`, from what `kept_for` gave (primary restored if it was
    compressed): bit for bit the tensor its producer made."""
    if make is None:
        return primary
    return make(primary, *extras, dtype=dtype).view(shape)


def restores_anew(how, keeper) -> bool:
    """Whether `restore` makes x anew (rebuilt from an offer, or from a compressed copy),
    rather than handing back a tensor the backward holds anyway."""
    make, _ = how
    return make is not None or not isinstance(keeper, Whole)


def keep(x, keeper):
    """(the tensors to save for x, how to read them back): `keeper` (a layer's `compress` and
    `restore`) compresses what x's producer offers, or x itself; the rest of the offer is
    saved as it is. `restore` turns them back into x."""
    primary, extras, make = kept_for(x, getattr(keeper, "bits_taken", None))
    saved = () if primary is None else keeper.compress(primary)
    return (*saved, *extras), (make, len(saved))


def restore(tensors, how, keeper, shape, dtype):
    """x, of `shape` and `dtype`, from what `keep` saved (`tensors`) and returned (`how`)."""
    make, n_saved = how
    saved, extras = tensors[:n_saved], tensors[n_saved:]
    primary = keeper.restore(saved, shape, dtype) if saved else None
    return rebuild(primary, extras, make, shape, dtype)
