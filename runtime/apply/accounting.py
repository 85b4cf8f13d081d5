"""Who saves what for the backward pass: bytes per module, each storage counted once.

Every tensor autograd saves passes a saved-tensors pack hook; forward hooks keep a stack of
the modules running, so each storage is charged to the innermost module running when it was
first saved. Parameters and buffers are not activations and are left out; copies made from
them alone (autocast's bfloat16 weights) are counted apart, as `constant`: they are made once
per step, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.hooks import observer


@dataclass
class SavedBytes:
    by_module: dict[str, int] = field(default_factory=dict)  # module name ("" the model)
    storages: dict[int, int] = field(default_factory=dict)  # storage_key -> bytes
    constant: int = 0  # bytes of weight copies, in storages but in no module's count
    # by module, the bytes among by_module's of the run's own inputs (an image a first
    # convolution keeps), which its caller holds whatever is kept
    given: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


# Autograd nodes that copy or view their one input: a saved tensor reached from a parameter
# through these alone is a weight copy, the same for any batch.
_COPY_NODES = ("ToCopyBackward", "TBackward", "TransposeBackward", "PermuteBackward",
               "ViewBackward", "UnsafeViewBackward", "ExpandBackward", "UnsqueezeBackward",
               "SqueezeBackward", "AliasBackward", "CloneBackward", "ReshapeAliasBackward")


def weight_copy(t: torch.Tensor) -> bool:
    """Whether `t` was computed from one trainable parameter by copies and views alone."""
    node = t.grad_fn
    while node is not None and type(node).__name__.rstrip("0123456789") in _COPY_NODES:
        inputs = [n for n, _ in node.next_functions if n is not None]
        node = inputs[0] if len(inputs) == 1 else None
    return node is not None and node is not t.grad_fn and hasattr(node, "variable")


def storage_key(t: torch.Tensor) -> int:
    """One key per storage, for real and fake tensors alike (a fake tensor's data pointer is 0):
    the address of its storage object, which views share."""
    return t.untyped_storage()._cdata


def account(model: torch.nn.Module, run, given=()) -> tuple[SavedBytes, object]:
    """(the bytes `run()`'s forward saves for backward, by module; run()'s result).
    `given`: run's own inputs, whose saved bytes are also told apart (`SavedBytes.given`)."""
    names = {m: n for n, m in model.named_modules()}
    stack = [""]
    skip = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    saved = SavedBytes()
    inputs = {storage_key(t) for t in given}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage_key(t)
        if ptr not in skip and ptr not in saved.storages and storage.nbytes():
            saved.storages[ptr] = storage.nbytes()
            if weight_copy(t):
                saved.constant += storage.nbytes()
            else:
                saved.by_module[stack[-1]] = saved.by_module.get(stack[-1], 0) + storage.nbytes()
                if ptr in inputs:
                    saved.given[stack[-1]] = saved.given.get(stack[-1], 0) + storage.nbytes()
        return t

    @observer
    def enter(module, args):
        stack.append(names[module])

    @observer
    def leave(module, args, output):  # returns None: a hook's result would replace the output
        stack.pop()

    handles = []
    for m in names:
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
    finally:
        for h in handles:
            h.remove()
    return saved, out
