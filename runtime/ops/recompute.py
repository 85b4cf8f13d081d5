"""Recomputation of named blocks: a block keeps only its inputs for the backward, and its
forward runs again there (torch.utils.checkpoint, non-reentrant).

The block's forward becomes an instance forward, so its name, parameters and state dict are
the untouched model's; it checkpoints while grad is enabled and the block is training, and
runs as it is otherwise. The recompute is exact: it replays torch's generators (dropout masks,
ActNN's seeds and so its codes) and runs under the forward's autocast state, so the backward
reads the tensors the forward made, bit for bit, whatever lossy method runs inside. Tensor
inputs given as keywords (transformers' position embeddings, masks) are passed to the
checkpoint as positional ones: it keeps them, as it keeps the positional ones, so the saved
bytes count them, and it stashes the generators of their devices.

With `offload`, the inputs the checkpoint keeps go to host memory (`offload`) and come back
for the block's backward.

Two updates the forward makes must not be made again by the recompute. As transformers' own
checkpointing does, a recomputed layer neither reads nor writes a key-value cache (the cache
arguments are None and `use_cache` False while it checkpoints; training starts each forward
with an empty one). BatchNorm layers update their running statistics in the forward only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .offload import offloaded

# (class forward, offload) -> the forward that checkpoints it: its identity tells ours
_FORWARDS = {}
# the names transformers' layers give their key-value cache
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")


def is_checkpoint_forward(forward) -> bool:
    """Whether an instance's forward is one `methods.checkpoint.plan_checkpoint` made."""
    return getattr(forward, "__func__", None) in _FORWARDS.values()


def recomputed_forward(cls, offload: bool = False):
    """cls.forward, checkpointed while grad is enabled and the module is training (and
    transformers' own checkpointing, turned on later, is off), its inputs on the host with
    `offload`; its signature is cls.forward's."""
    forward = cls.forward
    if (forward, offload) not in _FORWARDS:
        positional = _positional(forward)

        @functools.wraps(forward)
        def checkpointed(self, *args, **kwargs):
            if not (torch.is_grad_enabled() and self.training) \
                    or getattr(self, "gradient_checkpointing", False) is True:
                return forward(self, *args, **kwargs)
            args, kwargs = _without_cache(positional, self, args, kwargs)
            with offloaded() if offload else contextlib.nullcontext() as held:
                return _checkpointed_call(forward, self, args, kwargs, held)

        _FORWARDS[forward, offload] = checkpointed
    return _FORWARDS[forward, offload]


def _checkpointed_call(forward, block, args, kwargs, held=None):
    """forward(block, *args, **kwargs) under the checkpoint, every tensor in the arguments
    passed to it positionally. The recompute's call (every call after the first) leaves
    BatchNorm's running statistics as the forward left them, and, where the inputs wait on
    the host (`held`, offload's record of this block), starts fetching the block before's
    once it has run: its backward comes next, and this one's recompute is done with them."""
    leaves, layout = tree_flatten((args, kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    # the closure holds no tensor: the checkpoint keeps them (where a saved-tensors hook,
    # offloading say, may move them)
    rest = [None if isinstance(v, torch.Tensor) else v for v in leaves]
    calls = []

    def run(*tensors):
        values = list(rest)
        for i, t in zip(where, tensors, strict=True):
            values[i] = t
        call_args, call_kwargs = tree_unflatten(values, layout)
        again = bool(calls)
        calls.append(None)
        try:
            with _statistics_kept(block) if again else contextlib.nullcontext():
                return forward(block, *call_args, **call_kwargs)
        finally:  # also where the checkpoint stops the recompute early
            if again and held is not None:
                held.prefetch_previous()

    return checkpoint(run, *(leaves[i] for i in where), use_reentrant=False,
                      preserve_rng_state=True)


def _positional(forward) -> list[str]:
    """The names of a forward's positional parameters after self."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read: nothing is renamed
        return []
    return [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                 inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def _without_cache(positional, block, args, kwargs):
    """(args, kwargs) with the key-value cache arguments None and `use_cache` False, as
    transformers' checkpointing passes them, unless the layer's class says it only reads the
    cache. `positional` names the forward's positional parameters after self."""
    if getattr(block, "_can_checkpoint_with_cache", False):
        return args, kwargs
    named = _no_cache(dict(zip(positional, args, strict=False)))
    return tuple(named.get(name, v) for name, v in zip(positional, args, strict=False)) \
        + args[len(positional):], _no_cache(kwargs)


def _no_cache(values: dict) -> dict:
    out = dict(values)
    for name in _CACHES:
        if out.get(name) is not None:
            out[name] = None
    if out.get("use_cache") is True:
        out["use_cache"] = False
    return out


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _statistics_kept(block: nn.Module):
    """While open, the block's training BatchNorm layers update copies of their running
    statistics, which are dropped after: the originals stay as the forward left them. (Not
    updating them at all would save fewer tensors than the forward did: the checkpoint
    compares the two.)"""
    held = [(m, name, m._buffers[name]) for m in block.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
            and m.track_running_stats for name in _STATISTICS
            if m._buffers.get(name) is not None]
    for m, name, t in held:
        m._buffers[name] = t.clone()
    try:
        yield
    finally:
        for m, name, t in held:
            m._buffers[name] = t
