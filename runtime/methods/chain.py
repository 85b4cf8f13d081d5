"""`chain`: a convolutional chain keeps one tensor per norm (`ops.chains`). Exact: every
forward is eager's own, every backward eager's own formula on tensors rebuilt bit for bit.

- a BatchNorm keeps what eager's keeps and offers its output as a recipe from its input;
- an activation, or a norm without state (GroupNorm, a LayerNorm or RMSNorm, channels-first
  or not, a frozen BatchNorm), keeps only what makes its input again and runs again in the
  backward;
- an nn.MaxPool2d keeps a byte per output, its maximum's place in its window;
- the model's forward tracks the residual adds, squeeze-excite products and the like written
  in its blocks, so a block's output is a recipe too (from an ActNN batch norm's codes where
  `actnn` claims the norm first: `cnn+actnn2`).

The convolutions and Linear layers reading these tensors keep their recipes where a rule makes
them lean (the `cnn` preset does) or quantizes them. The module stays, under its own name and
class: its forward is set on the instance.
"""

from __future__ import annotations

from torch import nn

from actdesign.errors import ActdesignError

from ..ops.chains import (
    is_offering_forward,
    is_pooled_forward,
    is_recomputed_forward,
    is_tracked_forward,
    offering_forward,
    pooled_forward,
    recomputed_forward,
    tracked_forward,
    window_cells,
)
from ..ops.quantized_norms import offers_from_codes
from .base import Method, register
from .edits import BoundMethod, Edit

# random in training: run again, they would draw again
_DRAWING = ("RReLU",)


@register
class Chain(Method):
    name = "chain"
    targets = ("activation", "channel_norm", "norm", "pool")
    family = "llm"
    fallback = True

    def attached(self, module) -> bool:
        forward = module.__dict__.get("forward")
        return is_recomputed_forward(forward) or is_offering_forward(forward) \
            or is_pooled_forward(forward) or is_tracked_forward(forward)

    def replace(self, name, module, rule, draft) -> None:
        if "forward" in module.__dict__:
            raise ActdesignError("its forward is already replaced on the instance")
        cls = type(module)
        if rule.target == "pool":
            make, words = pooled_forward, _pool_words(module)
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            make, words = offering_forward, "keeps its input, as eager does, and offers its " \
                                            "output to its readers as a recipe from it"
        elif cls.__name__ in _DRAWING:
            raise ActdesignError(f"{cls.__name__} draws at random in training: run again in "
                                 "the backward it would draw again")
        else:
            make, words = recomputed_forward, "keeps only what makes its input again and " \
                                              "runs again in the backward (exact)"
        draft.edits.append(Edit(module, "forward", BoundMethod(module, make, cls)))
        draft.said(name, cls.__name__, words)

    def finish(self, draft) -> None:
        """The model's forward tracks the ops its blocks write (residual adds and the like),
        where a chain was planned."""
        model = draft.model
        chained = any(isinstance(e.value, BoundMethod) and (
            e.value._make in _CHAIN_FORWARDS or offers_from_codes(e.value)) for e in draft.edits)
        if not chained or is_tracked_forward(model.__dict__.get("forward")):
            return
        if "forward" in model.__dict__ or any(
                e.owner is model and e.name == "forward" for e in draft.edits):
            draft.skip("", model, "its forward is replaced on the instance already: the "
                                  "residual adds its blocks write keep their outputs whole")
            return
        draft.edits.append(Edit(model, "forward", BoundMethod(model, tracked_forward,
                                                              type(model))))
        draft.said("", type(model).__name__, "tracks its blocks' residual adds and products, "
                                             "whose outputs are then recipes too")


# the forwards that offer recipes (a max pool's does not), whose readers' inputs may be made
# by the ops a block writes
_CHAIN_FORWARDS = (offering_forward, recomputed_forward)


def _pool_words(pool) -> str:
    if type(pool).__name__ != "MaxPool2d":
        raise ActdesignError(f"{type(pool).__name__}: only nn.MaxPool2d keeps its offsets")
    if pool.return_indices:
        raise ActdesignError("it returns its indices, which its caller keeps")
    if window_cells(pool) > 256:
        raise ActdesignError(f"its window has {window_cells(pool)} cells: an offset would not "
                             "fit a byte")
    return "keeps a byte per output (its maximum's place in the window), not its input " \
           "and an int64 index"
