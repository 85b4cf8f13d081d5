"""The batch forms that `calibrate`, `calibrate_policy`, `plan` and `compress`'s probe take, and
how each is run: one reading, so a batch that works in one works in all of them.

- a tensor: the model's input, `model(batch)`;
- a dict (or any mapping, such as a transformers BatchEncoding): keyword inputs,
  `model(**batch)`; a transformers model given labels computes its own loss;
- a tuple or list: positional inputs, `model(*batch)`;
- an (inputs, targets) pair, a tuple or list of two tensors whose forward cannot take both
  as positional inputs (a classifier's `forward(x)`): `model(inputs)`, and the loss is the
  cross-entropy of that output against the targets.

Without targets the loss is the model's own (a `loss` in its output) or else the mean square
of its first output. Anything else is refused in one line naming these forms.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from actdesign.errors import ActdesignError

FORMS = ("a tensor, a dict of keyword inputs, a tuple or list of positional inputs, or an "
         "(inputs, targets) pair")


def parts(model, batch) -> tuple[tuple, dict, torch.Tensor | None]:
    """(positional inputs, keyword inputs, targets or None) of a batch for `model`."""
    if isinstance(batch, torch.Tensor):
        args, kwargs = (batch,), {}
    elif isinstance(batch, Mapping):
        if not all(isinstance(k, str) for k in batch):
            raise ActdesignError(f"a dict batch has keyword names as keys, got "
                                 f"{sorted(map(repr, batch))[:3]}; a batch is {FORMS}")
        args, kwargs = (), dict(batch)
    elif isinstance(batch, tuple | list):
        args, kwargs = tuple(batch), {}
    else:
        got = "None" if batch is None else f"a {type(batch).__name__}"
        raise ActdesignError(f"a batch is {FORMS}; got {got}")
    why = _refused(model, args, kwargs)
    if why is None:
        return args, kwargs, None
    if len(args) == 2 and all(isinstance(t, torch.Tensor) for t in args) \
            and _refused(model, args[:1], {}) is None:
        return args[:1], {}, args[1]
    raise ActdesignError(f"the model's forward does not take this batch ({why}); a batch is "
                         f"{FORMS}")


def iterate(batches, what: str = "batches"):
    """An iterator over `batches`, refused in one line when it is one batch (a tensor or a
    dict, whose rows or keys would be taken for batches) or not iterable."""
    if isinstance(batches, torch.Tensor | Mapping):
        raise ActdesignError(f"{what} is one batch (a {type(batches).__name__}), not an "
                             "iterable of batches: put it in a list")
    try:
        return iter(batches)
    except TypeError:
        raise ActdesignError(f"{what} is a {type(batches).__name__}, not an iterable of "
                             "batches") from None


def call(model, batch):
    """The model's output on a batch (targets aside)."""
    args, kwargs, _ = parts(model, batch)
    return model(*args, **kwargs)


def loss(model, batch) -> torch.Tensor:
    """The loss of a batch: cross-entropy against its targets, else the model's own."""
    args, kwargs, targets = parts(model, batch)
    output = model(*args, **kwargs)
    if targets is None:
        return loss_of(output)
    if not isinstance(output, torch.Tensor):
        raise ActdesignError(f"an (inputs, targets) batch needs a model returning a tensor of "
                             f"logits, got a {type(output).__name__}: give loss(model, batch)")
    return F.cross_entropy(output, targets)


def loss_of(output) -> torch.Tensor:
    """The model's own loss when it returns one; else the mean square of its first output."""
    loss = output.get("loss") if isinstance(output, dict) else None
    if loss is not None:
        return loss
    if not isinstance(output, torch.Tensor):
        leaves = output.values() if isinstance(output, dict) else output
        output = next(t for t in leaves if isinstance(t, torch.Tensor))
    return output.float().square().mean()


def _refused(model, args, kwargs) -> str | None:
    """Why the model's forward cannot take these inputs, by its signature; None if it can
    (or when it has no signature to read)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError, AttributeError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    return None
